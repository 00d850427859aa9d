"""The sparse wire codec of low-communication rounds (`--wire-codec sparse`): top-k of the pseudo-gradient plus the
node's error feedback, sent as positions and values, and the average every member computes from the same payloads.

SparseLoCo (templar) is the anchor: each node keeps the largest `fraction` of every tensor of (pseudo-gradient +
what it has not sent yet) and carries the rest in its error-feedback buffer (`lowcomm.rounds.InnerRounds`), so
nothing is dropped, only sent later. A round's values travel as fp16: `top_k(..., half=True)` rounds them before
they are offered, so the rounding error stays in the error feedback like everything else not sent. Every member
decodes the same bytes and sums them in fp32 in the group's order, so the average, and the outer step after it, are
the same bits on every node, and the parameters need no averaging after the round.

Payload layout (little-endian): magic `DSPR`, u32 count, u8 positions layout, u8 value type, then the positions and
`count` values (finite). Positions are either `count` u32 flat indices (strictly increasing, below the model's
element count) or a bitmask of the model's elements (bit i of byte i // 8, padding bits 0), whichever is smaller:
at the default top-10% the bitmask costs 1/8 byte per element where indices cost 4/10. Values are f32 or f16. Only
the smaller positions layout is accepted, so a set of positions has one encoding and a payload one bound.
Everything a stranger sends is checked before it is used.
"""
from __future__ import annotations

import math
import struct
from typing import Sequence

import numpy as np
import torch

MAGIC = b"DSPR"
HEADER = struct.Struct("<4sIBB")
INDICES, BITMASK = 0, 1  # positions layouts
F32, F16 = 0, 1  # value types
F16_MAX = 65504.0


class BadPayload(ValueError):
    """A sparse payload that is not one this codec writes for a model of this size."""


def kept(numel: int, fraction: float) -> int:
    """Elements of a tensor of `numel` a round sends: at least one of every non-empty tensor."""
    return min(numel, max(1, math.ceil(fraction * numel))) if numel else 0


def max_kept(sizes: Sequence[int], fraction: float) -> int:
    return sum(kept(n, fraction) for n in sizes)


def positions_bytes(count: int, total: int) -> int:
    """Bytes of the smaller positions layout for `count` of `total` elements."""
    return min(4 * count, (total + 7) // 8)


def payload_bytes(count: int, total: int, half: bool) -> int:
    """Size of a payload of `count` elements of a `total`-element model (the bound of one carrying at most `count`)."""
    return HEADER.size + positions_bytes(count, total) + (2 if half else 4) * count


def bytes_per_element(fraction: float, half: bool = True) -> float:
    """Wire bytes per model element of one payload (what the round deadlines are derived from)."""
    return min(4 * fraction, 1 / 8) + (2 if half else 4) * fraction


@torch.no_grad()
def top_k(tensors: Sequence[torch.Tensor], fraction: float, half: bool = False) -> list[torch.Tensor]:
    """Each tensor with all but its `kept` largest-magnitude elements set to 0 (ties: the lower index); with `half`,
    the kept values rounded to fp16 (clamped to its range), as they will travel."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        k = kept(flat.numel(), fraction)
        sparse = torch.zeros_like(flat)
        if k:
            idx = torch.topk(flat.abs(), k, sorted=False).indices
            values = flat[idx]
            if half:
                values = values.clamp(-F16_MAX, F16_MAX).half().to(flat.dtype)
            sparse[idx] = values
        out.append(sparse.view_as(t))
    return out


def encode(flat: torch.Tensor, half: bool = False) -> bytes:
    """The non-zero elements of a flat fp32 tensor as a payload; with `half` rounded to fp16 (clamped to its range).
    A node's offer is rounded before it is offered (`top_k(..., half=True)`), so the rounding is in its error
    feedback; what is left to round here is the last bit hivemind's accumulator scaling (x n, then x 1/n) moves."""
    flat = flat.detach().reshape(-1).to(torch.float32)
    total = flat.numel()
    idx = torch.nonzero(flat, as_tuple=True)[0].numpy()
    values = flat.numpy()[idx]
    wire = np.clip(values, -F16_MAX, F16_MAX).astype("<f2") if half else values.astype("<f4")
    if (total + 7) // 8 < 4 * idx.size:
        mask = np.zeros(total, dtype=bool)
        mask[idx] = True
        layout, positions = BITMASK, np.packbits(mask, bitorder="little").tobytes()
    else:
        layout, positions = INDICES, idx.astype("<u4").tobytes()
    return HEADER.pack(MAGIC, idx.size, layout, F16 if half else F32) + positions + wire.tobytes()


def decode(data: bytes, total: int, limit: int, half: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64, values f32) of a payload for a model of `total` elements carrying at most `limit` of them,
    with fp16 values if `half` else fp32."""
    if len(data) < HEADER.size:
        raise BadPayload(f"a payload of {len(data)} bytes has no header")
    magic, count, layout, kind = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadPayload(f"not a sparse payload (magic {magic!r})")
    if count > limit:
        raise BadPayload(f"{count} elements, more than the {limit} a round sends")
    if kind != (F16 if half else F32):
        raise BadPayload(f"value type {kind}, expected {'f16' if half else 'f32'}")
    want_layout = BITMASK if (total + 7) // 8 < 4 * count else INDICES
    if layout != want_layout:
        raise BadPayload(f"positions layout {layout} where the smaller one ({want_layout}) is due")
    expected = payload_bytes(count, total, half)
    if len(data) != expected:
        raise BadPayload(f"{len(data)} bytes for {count} elements (expected {expected})")
    pos_end = HEADER.size + positions_bytes(count, total)
    if layout == BITMASK:
        bits = np.unpackbits(np.frombuffer(data, np.uint8, pos_end - HEADER.size, HEADER.size), bitorder="little")
        if bits[total:].any():
            raise BadPayload(f"the bitmask marks elements at or past {total}")
        idx = np.flatnonzero(bits[:total])
        if idx.size != count:
            raise BadPayload(f"the bitmask marks {idx.size} elements, the header says {count}")
    else:
        idx = np.frombuffer(data, "<u4", count, HEADER.size).astype(np.int64)
        if count and (idx[-1] >= total or np.any(np.diff(idx) <= 0)):
            raise BadPayload(f"indices must increase strictly and stay below {total}")
    values = np.frombuffer(data, "<f2" if half else "<f4", count, pos_end).astype(np.float32)
    if not np.all(np.isfinite(values)):
        raise BadPayload("values must be finite")
    return torch.from_numpy(idx.astype(np.int64, copy=False)), torch.from_numpy(values)


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
