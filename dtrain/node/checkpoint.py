"""Checkpoints: parameters, optimizer state, epoch and loss history in one safetensors file, written atomically.

`state.safetensors` holds the parameters under `model.<name>` (dtrain's names, tied weights once, float32) and each
optimizer state tensor under `optimizer.<index>.<key>`; its metadata holds the rest as JSON (epoch, losses, the
optimizer's parameter groups and non-tensor state, the model config, the sync mode). Nothing is unpickled when it is
read. `dtrain-export --checkpoint DIR` turns one into a Hugging Face directory.

A low-comm node's checkpoint (docs/low-communication.md) holds the swarm's parameters at its epoch (the round's
anchor) under `model.`, the outer Nesterov step's momentum as its optimizer state (in 8 bits, its codes and scales:
node.lowcomm.momentum; files of earlier versions hold it in f32, rounded so when read), and the round in progress
(`RoundState`): the inner updates' parameters under `lowcomm.inner.<index>`, the error feedback under
`lowcomm.feedback.<index>` (sparse codec), the inner AdamW's state under `inner_optimizer.<index>.<key>`, and the
inner updates' count and the inner AdamW's groups in the `lowcomm` metadata; <index> is the parameter's position in
`model.parameters()`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from hivemind.utils.logging import get_logger
from safetensors import safe_open
from safetensors.torch import save_file

from dtrain.node.config import ModelConfig
from dtrain.node.lowcomm import momentum as momentum8

logger = get_logger(__name__)

CHECKPOINT_NAME = "state.safetensors"
FORMAT = "dtrain-checkpoint-1"
LEGACY_NAME = "state.pt"  # the pickled format of earlier versions: refused, never unpickled


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as one; the message says what is wrong."""


@dataclass
class RoundState:
    """A low-comm node's round in progress (node.lowcomm.rounds.InnerRounds); tensors in model.parameters() order."""

    inner_params: list  # the inner updates' parameters (the anchor minus the pseudo-gradient)
    feedback: Optional[list]  # the sparse codec's error feedback; None with a dense codec
    steps: int  # inner updates since the anchor
    inner_optimizer_state: dict  # the inner AdamW's state_dict()


@dataclass
class Checkpoint:
    params: dict  # name -> tensor: model.named_parameters(), tied weights once (low-comm: the round's anchor)
    optimizer_state: dict  # the local torch optimizer's state_dict() (low-comm: the outer Nesterov step's)
    epoch: int  # hivemind epoch (updates applied); the API's step is epoch + 1
    losses: list  # loss history, one entry per update this node applied
    model_config: Optional[ModelConfig] = None  # the model's shape (for export), None in files that lack it
    sync: Optional[str] = None  # per-step or low-comm; None in files that lack it (sync_mode() infers it)
    round: Optional[RoundState] = None  # low-comm: the round in progress; None in files that lack it

    def sync_mode(self) -> str:
        """The sync mode that wrote it; files without one say it by their optimizer's state (the outer step's
        momentum, or AdamW's moments)."""
        if self.sync is not None:
            return self.sync
        keys = {key for state in self.optimizer_state["state"].values() for key in state}
        return "low-comm" if "momentum_codes" in keys else "per-step"


def _optimizer_tensors(prefix: str, state_dict: dict, tensors: dict) -> dict[str, dict[str, Any]]:
    """Each state tensor of a torch optimizer's state_dict into `tensors` as <prefix>.<index>.<key>; the rest."""
    scalars: dict[str, dict[str, Any]] = {}
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}.{index}.{key}"] = value.detach().contiguous().clone()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return scalars


def _optimizer_state(prefix: str, tensors: dict, scalars_json: str, groups_json: str) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key.startswith(prefix + "."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = t
    for index, values in json.loads(scalars_json).items():
        state.setdefault(int(index), {}).update(values)
    groups = json.loads(groups_json)
    for group in groups:  # JSON has no tuples; torch's optimizers keep betas as one
        for key, value in group.items():
            if key != "params" and isinstance(value, list):
                group[key] = tuple(value)
    return {"state": state, "param_groups": groups}


def _momentum_in_8_bits(state_dict: dict) -> dict:
    """A low-comm file of an earlier version holds the outer momentum in f32 ("momentum_buffer"): rounded to the
    8-bit form the node keeps it in (node.lowcomm.momentum), as its next outer step would."""
    if not any("momentum_buffer" in state for state in state_dict["state"].values()):
        return state_dict
    for state in state_dict["state"].values():
        buf = state.pop("momentum_buffer", None)
        if torch.is_tensor(buf):
            codes, scales = momentum8.zeros(buf)
            momentum8.quantize_(buf.to(torch.float32), codes, scales)
            state.update(momentum_codes=codes, momentum_scales=scales)
    for group in state_dict["param_groups"]:
        group.setdefault("momentum_block", momentum8.BLOCK)
    return state_dict


def _indexed(prefix: str, tensors: dict) -> list:
    """<prefix>.<index> tensors in index order (no gaps: checked by the caller against the model)."""
    found = {int(key[len(prefix) + 1:]): t for key, t in tensors.items() if key.startswith(prefix + ".")}
    return [found[i] for i in sorted(found)]


def save(directory: str | Path, checkpoint: Checkpoint) -> Path:
    """Write to a temporary file, fsync, then rename: a crash never leaves a half-written checkpoint."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / CHECKPOINT_NAME
    tmp = directory / (CHECKPOINT_NAME + ".tmp")
    tensors = {f"model.{name}": t.detach().to(torch.float32).contiguous().clone()
               for name, t in checkpoint.params.items()}
    scalars = _optimizer_tensors("optimizer", checkpoint.optimizer_state, tensors)
    metadata = {
        "format": FORMAT,
        "epoch": str(int(checkpoint.epoch)),
        "losses": json.dumps([float(x) for x in checkpoint.losses]),
        "param_groups": json.dumps(checkpoint.optimizer_state["param_groups"]),
        "optimizer_scalars": json.dumps(scalars),
    }
    if checkpoint.model_config is not None:
        metadata["model_config"] = json.dumps(dataclasses.asdict(checkpoint.model_config))
    if checkpoint.sync is not None:
        metadata["sync"] = checkpoint.sync
    if (round_ := checkpoint.round) is not None:
        for i, t in enumerate(round_.inner_params):
            tensors[f"lowcomm.inner.{i}"] = t.detach().to(torch.float32).contiguous().clone()
        for i, t in enumerate(round_.feedback or ()):
            tensors[f"lowcomm.feedback.{i}"] = t.detach().to(torch.float32).contiguous().clone()
        inner_scalars = _optimizer_tensors("inner_optimizer", round_.inner_optimizer_state, tensors)
        metadata["lowcomm"] = json.dumps({
            "steps": int(round_.steps), "feedback": round_.feedback is not None,
            "inner_param_groups": round_.inner_optimizer_state["param_groups"],
            "inner_optimizer_scalars": inner_scalars})
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    logger.info(f"Saved checkpoint at epoch {checkpoint.epoch} to {final}")
    return final


def load(directory: str | Path) -> Optional[Checkpoint]:
    """The checkpoint in `directory`, or None when it has none."""
    directory = Path(directory)
    path = directory / CHECKPOINT_NAME
    if not path.exists():
        if (directory / LEGACY_NAME).exists():
            raise CheckpointError(f"{directory / LEGACY_NAME} is a pickled checkpoint of an earlier dtrain, which this "
                                  f"version does not unpickle; start the node without it (it downloads the swarm's "
                                  f"state) or move the file away")
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise CheckpointError(f"{path}: not a dtrain checkpoint (format {metadata.get('format')!r})")
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        params = {key[len("model."):]: t for key, t in tensors.items() if key.startswith("model.")}
        optimizer_state = _momentum_in_8_bits(_optimizer_state("optimizer", tensors, metadata["optimizer_scalars"],
                                                               metadata["param_groups"]))
        round_ = None
        if "lowcomm" in metadata:
            info = json.loads(metadata["lowcomm"])
            round_ = RoundState(
                inner_params=_indexed("lowcomm.inner", tensors),
                feedback=_indexed("lowcomm.feedback", tensors) if info["feedback"] else None,
                steps=int(info["steps"]),
                inner_optimizer_state=_optimizer_state("inner_optimizer", tensors,
                                                       json.dumps(info["inner_optimizer_scalars"]),
                                                       json.dumps(info["inner_param_groups"])))
        config = json.loads(metadata["model_config"]) if "model_config" in metadata else None
        return Checkpoint(params=params, optimizer_state=optimizer_state,
                          epoch=int(metadata["epoch"]), losses=list(json.loads(metadata["losses"])),
                          model_config=ModelConfig(**config) if config is not None else None,
                          sync=metadata.get("sync"), round=round_)
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or foreign file: say which, never half-load
        raise CheckpointError(f"{path}: cannot be read as a dtrain checkpoint ({e!r})") from None


MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "momentum_codes")  # optimizer state tensors of a parameter's shape


def check_fits(checkpoint: Checkpoint, where: str, model: torch.nn.Module, sync: str,
               feedback: bool) -> None:
    """Raise CheckpointError, naming what differs, unless every part of `checkpoint` fits this node: its model's
    parameters, the sync mode, and in low-comm mode its round (`feedback`: the node's codec keeps error feedback).
    Called before anything of it is applied, so a checkpoint is taken whole or not at all."""
    own = dict(model.named_parameters())
    shapes = [tuple(p.shape) for p in own.values()]
    if set(checkpoint.params) != set(own):
        extra, missing = sorted(set(checkpoint.params) - set(own)), sorted(set(own) - set(checkpoint.params))
        raise CheckpointError(f"{where}: its parameters are not this model's: unexpected {extra[:4]}, "
                              f"missing {missing[:4]}")
    for name, p in own.items():
        if tuple(checkpoint.params[name].shape) != tuple(p.shape):
            raise CheckpointError(f"{where}: {name} has shape {tuple(checkpoint.params[name].shape)}, this model's "
                                  f"is {tuple(p.shape)}")
    written = checkpoint.sync_mode()
    if written != sync:
        raise CheckpointError(f"{where} was written by a {written} node and this node syncs {sync}: start it with "
                              f"--sync {written}, or without this checkpoint (it downloads the swarm's state)")
    _check_optimizer(checkpoint.optimizer_state, shapes, f"{where}: the optimizer state")
    round_ = checkpoint.round
    if round_ is None:
        return
    for name, tensors in (("inner parameters", round_.inner_params), ("error feedback", round_.feedback or [])):
        if tensors and [tuple(t.shape) for t in tensors] != shapes:
            raise CheckpointError(f"{where}: the round's {name} are {len(tensors)} tensors that do not match the "
                                  f"model's {len(shapes)} parameters")
    if len(round_.inner_params) != len(shapes):
        raise CheckpointError(f"{where}: the round holds {len(round_.inner_params)} inner parameters, the model "
                              f"has {len(shapes)}")
    if round_.feedback is not None and not feedback:
        raise CheckpointError(f"{where} carries the sparse codec's error feedback, which this node's --wire-codec "
                              f"keeps nowhere: start it with --wire-codec sparse, or without this checkpoint")
    _check_optimizer(round_.inner_optimizer_state, shapes, f"{where}: the inner AdamW's state")


def _check_optimizer(state_dict: dict, shapes: list, what: str) -> None:
    indices = [i for group in state_dict["param_groups"] for i in group["params"]]
    if sorted(indices) != list(range(len(shapes))):
        raise CheckpointError(f"{what} is for {len(indices)} parameters, the model has {len(shapes)}")
    for index, state in state_dict["state"].items():
        for key in MOMENT_KEYS:
            if key in state and tuple(state[key].shape) != shapes[index]:
                raise CheckpointError(f"{what}: parameter {index}'s {key} has shape {tuple(state[key].shape)}, "
                                      f"the parameter's is {shapes[index]}")
        scales = state.get("momentum_scales")
        want = (momentum8.blocks(math.prod(shapes[index])),)
        if scales is not None and tuple(scales.shape) != want:
            raise CheckpointError(f"{what}: parameter {index}'s momentum_scales has shape {tuple(scales.shape)}, "
                                  f"not {want} (a scale per {momentum8.BLOCK} elements)")
