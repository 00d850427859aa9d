"""Config dataclass fields that are also command-line flags: the flag, its help and argparse details live on
the field itself (`dataclasses.field` metadata), so the CLI is derived from the dataclasses, never kept beside
them by hand."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

BOOLEAN_ACTIONS = ("store_true", "store_false")


def option(default: Any, flag: str, help: str, *, without: Optional[str] = None, **argparse_kwargs: Any):
    """A dataclass field with a default that `dtrain-node` exposes as `flag`.

    A boolean flag (`action="store_true"` or `"store_false"`) also says in `without` what the node does when the
    flag is not given: "(default True)" after `--no-relay` would read as if the flag were on."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("config defaults must be immutable")
    boolean = argparse_kwargs.get("action") in BOOLEAN_ACTIONS
    if boolean and not without:
        raise TypeError(f"{flag} is a boolean flag: say what the node does without it (option(..., without=...))")
    if without and not boolean:
        raise TypeError(f"{flag} takes a value: its help shows the default, `without` is for boolean flags")
    metadata = {"flag": flag, "help": help, "without": without, "argparse": argparse_kwargs}
    return dataclasses.field(default=default, metadata=metadata)


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of a config dataclass that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]
