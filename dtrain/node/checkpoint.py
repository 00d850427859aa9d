"""Checkpoints: parameters, optimizer state, epoch and loss history, written atomically."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

CHECKPOINT_NAME = "state.pt"


@dataclass
class Checkpoint:
    model_state: dict  # model.state_dict()
    optimizer_state: dict  # the local torch optimizer's state_dict()
    epoch: int  # hivemind epoch (updates applied); the API's step is epoch + 1
    losses: list  # loss history, one entry per update this node applied


def save(directory: str | Path, checkpoint: Checkpoint) -> Path:
    """Write to a temporary file, fsync, then rename: a crash never leaves a half-written checkpoint."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / CHECKPOINT_NAME
    tmp = directory / (CHECKPOINT_NAME + ".tmp")
    payload = {
        "model": checkpoint.model_state,
        "optimizer": checkpoint.optimizer_state,
        "epoch": checkpoint.epoch,
        "losses": list(checkpoint.losses),
    }
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    logger.info(f"Saved checkpoint at epoch {checkpoint.epoch} to {final}")
    return final


def load(directory: str | Path) -> Optional[Checkpoint]:
    path = Path(directory) / CHECKPOINT_NAME
    if not path.exists():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=True)
    return Checkpoint(payload["model"], payload["optimizer"], int(payload["epoch"]), list(payload["losses"]))
