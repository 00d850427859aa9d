"""The parameters of one step as other threads read them: immutable FP32 and FP16 copies and their digest."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch


@dataclass(frozen=True)
class Snapshot:
    """The parameters of one step; never mutated after publication, so readers need no lock."""

    step: int  # API step: hivemind epoch + 1
    updates: int  # optimizer updates applied (the epoch)
    f32: tuple[np.ndarray, ...]  # flat float32 copies in manifest order
    f16: tuple[np.ndarray, ...]  # the same, converted to FP16 once per step
    digest: str  # sha256 over the FP32 bytes of every tensor in order


def digest(arrays: Iterable[np.ndarray]) -> str:
    """sha256 over the float32 bytes of every parameter in manifest order (Snapshot.digest)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).data)
    return h.hexdigest()


def params_digest(model: torch.nn.Module) -> str:
    """The digest of the live parameters, without the copies and FP16 conversion a snapshot makes."""
    return digest(p.detach().reshape(-1).numpy() for p in model.parameters())


def make_snapshot(model: torch.nn.Module, epoch: int) -> Snapshot:
    f32 = tuple(p.detach().reshape(-1).numpy().copy() for p in model.parameters())
    for a in f32:
        a.setflags(write=False)
    f16 = tuple(a.astype(np.float16) for a in f32)
    for a in f16:
        a.setflags(write=False)
    return Snapshot(step=epoch + 1, updates=epoch, f32=f32, f16=f16, digest=digest(f32))
