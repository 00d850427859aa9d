"""Checkpoints: parameters, optimizer state, epoch and loss history in one safetensors file, written atomically.

`state.safetensors` holds the parameters under `model.<name>` (dtrain's names, tied weights once, float32) and each
optimizer state tensor under `optimizer.<index>.<key>`; its metadata holds the rest as JSON (epoch, losses, the
optimizer's parameter groups and non-tensor state, the model config). Nothing is unpickled when it is read.
`dtrain-export --checkpoint DIR` turns one into a Hugging Face directory.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from hivemind.utils.logging import get_logger
from safetensors import safe_open
from safetensors.torch import save_file

from dtrain.node.config import ModelConfig

logger = get_logger(__name__)

CHECKPOINT_NAME = "state.safetensors"
FORMAT = "dtrain-checkpoint-1"
LEGACY_NAME = "state.pt"  # the pickled format of earlier versions: refused, never unpickled


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as one; the message says what is wrong."""


@dataclass
class Checkpoint:
    params: dict  # name -> tensor: model.named_parameters(), tied weights once
    optimizer_state: dict  # the local torch optimizer's state_dict()
    epoch: int  # hivemind epoch (updates applied); the API's step is epoch + 1
    losses: list  # loss history, one entry per update this node applied
    model_config: Optional[ModelConfig] = None  # the model's shape (for export), None in files that lack it


def save(directory: str | Path, checkpoint: Checkpoint) -> Path:
    """Write to a temporary file, fsync, then rename: a crash never leaves a half-written checkpoint."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / CHECKPOINT_NAME
    tmp = directory / (CHECKPOINT_NAME + ".tmp")
    tensors = {f"model.{name}": t.detach().to(torch.float32).contiguous().clone()
               for name, t in checkpoint.params.items()}
    scalars: dict[str, dict[str, Any]] = {}
    for index, state in checkpoint.optimizer_state["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value.detach().contiguous().clone()
            else:
                scalars.setdefault(str(index), {})[key] = value
    metadata = {
        "format": FORMAT,
        "epoch": str(int(checkpoint.epoch)),
        "losses": json.dumps([float(x) for x in checkpoint.losses]),
        "param_groups": json.dumps(checkpoint.optimizer_state["param_groups"]),
        "optimizer_scalars": json.dumps(scalars),
    }
    if checkpoint.model_config is not None:
        metadata["model_config"] = json.dumps(dataclasses.asdict(checkpoint.model_config))
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
        state: dict[int, dict[str, Any]] = {}
        for key, t in tensors.items():
            if key.startswith("optimizer."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = t
        for index, values in json.loads(metadata["optimizer_scalars"]).items():
            state.setdefault(int(index), {}).update(values)
        groups = json.loads(metadata["param_groups"])
        for group in groups:  # JSON has no tuples; torch's optimizers keep betas as one
            for key, value in group.items():
                if key != "params" and isinstance(value, list):
                    group[key] = tuple(value)
        config = json.loads(metadata["model_config"]) if "model_config" in metadata else None
        return Checkpoint(params=params, optimizer_state={"state": state, "param_groups": groups},
                          epoch=int(metadata["epoch"]), losses=list(json.loads(metadata["losses"])),
                          model_config=ModelConfig(**config) if config is not None else None)
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or foreign file: say which, never half-load
        raise CheckpointError(f"{path}: cannot be read as a dtrain checkpoint ({e!r})") from None
