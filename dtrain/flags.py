"""`dtrain-node`'s flags, derived from the config dataclasses' fields (`node.options.option`).

A flag's name in a YAML/JSON `--config` file is its argparse dest: `--target-batch-size` is `target_batch_size`
(or `target-batch-size`), `--no-he` is `he`, `--expert` is `expert`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from dtrain.node.config import ConfigError, NodeConfig, SwarmConfig
from dtrain.node.options import flag_fields
from dtrain.node.serve.config import ServeConfig
from dtrain.node.split.config import SplitConfig, parse_expert_flag

# (argument group, dataclass, NodeConfig field holding it or None for NodeConfig itself)
SECTIONS = (("swarm", SwarmConfig, "swarm"), ("node", NodeConfig, None), ("split inference", SplitConfig, "split"),
            ("serving (OpenAI-compatible API, capture, feedback)", ServeConfig, "serve"))


def dest(f: dataclasses.Field) -> str:
    return f.metadata["argparse"].get("dest") or f.metadata["flag"].lstrip("-").replace("-", "_")


def _value_type(f: dataclasses.Field):
    annotation = str(f.type)
    if "Sequence" in annotation or "tuple" in annotation or "bool" in annotation:
        return None
    if "float" in annotation:
        return float
    if "int" in annotation:
        return int
    return str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dtrain-node",
        description="Run one node of a dtrain swarm: hivemind peer, Training API v1 bridge and split inference.",
    )
    p.add_argument("--config", help="YAML or JSON file with any of the options below (flags override it)")
    for title, cls, _ in SECTIONS:
        group = p.add_argument_group(title)
        for f in flag_fields(cls):
            kwargs = dict(f.metadata["argparse"])
            kwargs["dest"] = dest(f)
            if kwargs.get("action") is None and _value_type(f) is not None:
                kwargs["type"] = _value_type(f)
            group.add_argument(f.metadata["flag"], help=describe(f), default=None, **kwargs)
    return p


def describe(f: dataclasses.Field) -> str:
    """A flag's help as `--help` prints it: what the flag does, then, for a boolean flag, what the node does without
    it (its field's default is the flag's absence: "(default True)" after `--no-relay` would read as if the flag
    were on), and for a flag with a value, its default value."""
    if f.metadata["without"]:
        return f"{f.metadata['help']} (without it: {f.metadata['without']})"
    if f.default in (None, ()):
        return f.metadata["help"]
    return f"{f.metadata['help']} (default {_show(f.default)})"


def _show(value: Any) -> str:
    return " ".join(value) if isinstance(value, tuple) else str(value)


def _load_file(path: str) -> dict:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


def parse_config(argv: Optional[Sequence[str]] = None) -> NodeConfig:
    args = build_parser().parse_args(argv)
    values = _load_file(args.config) if args.config else {}
    known = {dest(f) for _, cls, _ in SECTIONS for f in flag_fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{args.config}: unknown option(s) {unknown}")
    for name, value in vars(args).items():
        if name != "config" and value is not None:
            values[name] = value
    sections = {}
    for _, cls, holder in SECTIONS:
        kwargs = {f.name: _convert(f, values[dest(f)]) for f in flag_fields(cls) if dest(f) in values}
        sections[holder] = (cls, kwargs)
    try:
        swarm = SwarmConfig(**sections["swarm"][1])
        split = SplitConfig(**sections["split"][1])
        serve = ServeConfig(**sections["serve"][1])
        return NodeConfig(swarm=swarm, split=split, serve=serve, **sections[None][1])
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None


def _convert(f: dataclasses.Field, value: Any) -> Any:
    if f.name == "experts":
        # flags give ["NAME=PATH", ...]; a config file may also give {NAME: PATH} or one "NAME=PATH"
        if isinstance(value, dict):
            items = value.items()
        else:
            items = [parse_expert_flag(e) if isinstance(e, str) else tuple(e)
                     for e in ([value] if isinstance(value, str) else value)]
        return tuple((str(name), str(path)) for name, path in items)
    if f.metadata["argparse"].get("nargs"):
        return (value,) if isinstance(value, str) else tuple(value)
    return value


def markdown_table() -> str:
    """docs/configuration.md's flag table, one row per flag (`python -m dtrain.flags` prints it)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for _, cls, _ in SECTIONS:
        for f in flag_fields(cls):
            default = f.default
            if f.name == "static_dir":
                default = "static/"
            shown = "none" if default in (None, ()) else f"`{_show(default)}`"
            meaning = f.metadata["help"]
            if f.metadata["without"]:  # a boolean flag: off unless given
                shown, meaning = "off", f"{meaning}; without it: {f.metadata['without']}"
            flag = f.metadata["flag"]
            if f.metadata["argparse"].get("metavar"):
                flag += f" {f.metadata['argparse']['metavar']}"
            rows.append(f"| `{flag}` | {shown} | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
