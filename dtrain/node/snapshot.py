"""The parameters of one step as other threads read them: immutable FP32 and FP16 copies and their digest.

Each format is one contiguous buffer in an anonymous in-memory file (memfd): the per-tensor arrays are views of
it, and a download of any tensor slice is a byte range of that file, which the kernel can send to a socket with
sendfile() without the bytes passing through Python.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
import threading
from dataclasses import dataclass, field
from typing import BinaryIO, Iterable, Optional

import numpy as np
import torch


class _Half:
    """A snapshot's FP16 copy, converted on first use (under a lock: the bridge's threads may ask together)."""

    def __init__(self, f32_flat: torch.Tensor, sizes: list[int]):
        self._f32_flat, self._sizes = f32_flat, sizes  # the FP32 buffer, as a tensor made while it was writable
        self._lock = threading.Lock()
        self._built: Optional[tuple[tuple[np.ndarray, ...], BinaryIO]] = None

    def get(self) -> tuple[tuple[np.ndarray, ...], BinaryIO]:
        with self._lock:
            if self._built is None:
                f16_file, f16_bytes = _file_buffer(2 * self._f32_flat.numel(), "dtrain-snapshot-f16")
                f16_flat = f16_bytes.view(np.float16)
                # torch converts with F16C, ~15x faster than numpy's software cast; both round to nearest even, so
                # the bytes equal numpy's astype(float16) (the conformance test compares them)
                torch.from_numpy(f16_flat).copy_(self._f32_flat)
                f16_flat.setflags(write=False)
                self._built = (_views(f16_flat, self._sizes), f16_file)
            return self._built


@dataclass(frozen=True)
class Snapshot:
    """The parameters of one step; never mutated after publication, so readers need no lock.

    The FP16 copy is made on first use (`f16`, `f16_file`): a node no browser downloads from holds none."""

    step: int  # API step: hivemind epoch + 1
    updates: int  # optimizer updates applied (the epoch)
    f32: tuple[np.ndarray, ...]  # flat float32 copies in manifest order (read-only views of f32_file)
    digest: str  # sha256 over the FP32 bytes of every tensor in order
    # The files behind f32 / f16: tensor i starts at byte f32_offsets[i] (f16_offsets[i]); None when built by hand.
    f32_file: Optional[BinaryIO] = field(default=None, repr=False, compare=False)
    f32_offsets: tuple[int, ...] = field(default=(), repr=False, compare=False)
    f16_offsets: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _half: Optional[_Half] = field(default=None, repr=False, compare=False)

    @property
    def f16(self) -> tuple[np.ndarray, ...]:
        """The same, converted to FP16 once per step (read-only views of f16_file)."""
        return self._half.get()[0]

    @property
    def f16_file(self) -> BinaryIO:
        return self._half.get()[1]


def digest(arrays: Iterable[np.ndarray]) -> str:
    """sha256 over the float32 bytes of every parameter in manifest order (Snapshot.digest)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).data)
    return h.hexdigest()


def params_digest(model: torch.nn.Module) -> str:
    """The digest of the live parameters, without the copies and FP16 conversion a snapshot makes."""
    return digest(p.detach().reshape(-1).numpy() for p in model.parameters())


def _file_buffer(nbytes: int, name: str) -> tuple[BinaryIO, np.ndarray]:
    """A writable uint8 array of `nbytes` backed by an anonymous file, and that file (kept open for sendfile).

    The mapping is MAP_SHARED, so the array's pages are the file's: no second copy for downloads. The memory goes
    back to the system once both the file and the array are gone.
    """
    if hasattr(os, "memfd_create"):
        fobj: BinaryIO = os.fdopen(os.memfd_create(name, os.MFD_CLOEXEC), "rb")
    else:  # not Linux: a deleted temporary file does the same through the page cache
        fobj = tempfile.TemporaryFile()
    os.ftruncate(fobj.fileno(), max(nbytes, 1))  # mmap refuses length 0
    mapping = mmap.mmap(fobj.fileno(), max(nbytes, 1))
    return fobj, np.frombuffer(mapping, np.uint8, count=nbytes)


def _views(flat: np.ndarray, sizes: list[int]) -> tuple[np.ndarray, ...]:
    bounds = np.cumsum([0] + sizes)
    out = tuple(flat[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    for a in out:
        a.setflags(write=False)
    return out


def make_snapshot(model: torch.nn.Module, epoch: int, known_digest: Optional[str] = None) -> Snapshot:
    """`known_digest`: the parameters' digest, computed since they last changed (PendingSnapshot): not again."""
    params = [p.detach().reshape(-1) for p in model.parameters()]
    sizes = [int(p.numel()) for p in params]
    total = sum(sizes)
    f32_file, f32_bytes = _file_buffer(4 * total, "dtrain-snapshot-f32")
    f32_flat = f32_bytes.view(np.float32)
    f32_tensor = torch.from_numpy(f32_flat)
    if params:
        torch.cat(params, out=f32_tensor)
    f32 = _views(f32_flat, sizes)
    f32_flat.setflags(write=False)
    offsets = np.cumsum([0] + sizes[:-1]).tolist() if sizes else []
    return Snapshot(step=epoch + 1, updates=epoch, f32=f32, digest=known_digest or digest(f32), f32_file=f32_file,
                    f32_offsets=tuple(4 * o for o in offsets), f16_offsets=tuple(2 * o for o in offsets),
                    _half=_Half(f32_tensor, sizes))


@dataclass(frozen=True)
class PendingSnapshot:
    """The parameters of one step by their digest alone, before their snapshot is made: what the peers of an update
    agree on (node.swarm.agreement), so that the copy can be made once what the update's round held is gone.
    Nothing may write the parameters before `make`."""

    updates: int
    digest: str

    @classmethod
    def of(cls, model: torch.nn.Module, epoch: int) -> "PendingSnapshot":
        return cls(epoch, params_digest(model))

    def make(self, model: torch.nn.Module) -> Snapshot:
        return make_snapshot(model, self.updates, known_digest=self.digest)
