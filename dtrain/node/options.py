"""Config dataclass fields that are also command-line flags: the flag, its help and argparse details live on
the field itself (`dataclasses.field` metadata), so the CLI is derived from the dataclasses, never kept beside
them by hand."""
from __future__ import annotations

import dataclasses
from typing import Any


def option(default: Any, flag: str, help: str, **argparse_kwargs: Any):
    """A dataclass field with a default that `dtrain-node` exposes as `flag`."""
    metadata = {"flag": flag, "help": help, "argparse": argparse_kwargs}
    if isinstance(default, (list, dict, set)):
        raise TypeError("config defaults must be immutable")
    return dataclasses.field(default=default, metadata=metadata)


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of a config dataclass that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]
