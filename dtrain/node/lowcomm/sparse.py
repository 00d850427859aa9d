"""The sparse wire codec of low-communication rounds (`--wire-codec sparse`): top-k of the pseudo-gradient plus the
node's error feedback, sent as (index, value) pairs, and the average every member computes from the same payloads.

SparseLoCo (templar) is the anchor: each node keeps the largest `fraction` of every tensor of (pseudo-gradient +
what it has not sent yet) and carries the rest in its error-feedback buffer (`lowcomm.rounds.InnerRounds`), so
nothing is dropped, only sent later. The values travel as they are (fp32): every member decodes the same bytes and
sums them in the group's order, so the average, and the outer step after it, are the same bits on every node, and
the parameters need no averaging after the round.

Payload layout (little-endian): magic `DSPR`, u32 count, then `count` u32 flat indices (strictly increasing, below the
model's element count), then `count` f32 values (finite). Everything a stranger sends is checked before it is used.
"""
from __future__ import annotations

import math
import struct
from typing import Sequence

import numpy as np
import torch

MAGIC = b"DSPR"
HEADER = struct.Struct("<4sI")
BYTES_PER_KEPT = 8  # a u32 index and an f32 value


class BadPayload(ValueError):
    """A sparse payload that is not one this codec writes for a model of this size."""


def kept(numel: int, fraction: float) -> int:
    """Elements of a tensor of `numel` a round sends: at least one of every non-empty tensor."""
    return min(numel, max(1, math.ceil(fraction * numel))) if numel else 0


def max_kept(sizes: Sequence[int], fraction: float) -> int:
    return sum(kept(n, fraction) for n in sizes)


def bytes_per_element(fraction: float) -> float:
    """Wire bytes per model element of one payload (what the round deadlines are derived from)."""
    return BYTES_PER_KEPT * fraction


@torch.no_grad()
def top_k(tensors: Sequence[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    """Each tensor with all but its `kept` largest-magnitude elements set to 0 (ties: the lower index)."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        k = kept(flat.numel(), fraction)
        sparse = torch.zeros_like(flat)
        if k:
            idx = torch.topk(flat.abs(), k, sorted=False).indices
            sparse[idx] = flat[idx]
        out.append(sparse.view_as(t))
    return out


def encode(flat: torch.Tensor) -> bytes:
    """The non-zero elements of a flat fp32 tensor as a payload."""
    flat = flat.detach().reshape(-1).to(torch.float32)
    idx = torch.nonzero(flat, as_tuple=True)[0]
    values = flat[idx].numpy().astype("<f4")
    return HEADER.pack(MAGIC, idx.numel()) + idx.numpy().astype("<u4").tobytes() + values.tobytes()


def decode(data: bytes, total: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64, values f32) of a payload for a model of `total` elements carrying at most `limit` of them."""
    if len(data) < HEADER.size:
        raise BadPayload(f"a payload of {len(data)} bytes has no header")
    magic, count = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadPayload(f"not a sparse payload (magic {magic!r})")
    if count > limit:
        raise BadPayload(f"{count} elements, more than the {limit} a round sends")
    if len(data) != HEADER.size + BYTES_PER_KEPT * count:
        raise BadPayload(f"{len(data)} bytes for {count} elements (expected {HEADER.size + BYTES_PER_KEPT * count})")
    idx = np.frombuffer(data, "<u4", count, HEADER.size).astype(np.int64)
    values = np.frombuffer(data, "<f4", count, HEADER.size + 4 * count).astype(np.float32)
    if count and (idx[-1] >= total or np.any(np.diff(idx) <= 0)):
        raise BadPayload(f"indices must increase strictly and stay below {total}")
    if not np.all(np.isfinite(values)):
        raise BadPayload("values must be finite")
    return torch.from_numpy(idx), torch.from_numpy(values)


def average(payloads: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float],
            total: int) -> torch.Tensor:
    """The weighted mean of decoded payloads as a flat fp32 tensor: the same bits for the same payloads, weights and
    order on every machine (one element-wise pass per payload, in the given order)."""
    if len(payloads) != len(weights) or not payloads:
        raise ValueError("one weight per payload, at least one payload")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    norm = float(sum(weights))
    out = torch.zeros(total, dtype=torch.float32)
    if norm == 0:
        return out
    for (idx, values), w in zip(payloads, weights):
        out.index_add_(0, idx, values * np.float32(w / norm))
    return out
