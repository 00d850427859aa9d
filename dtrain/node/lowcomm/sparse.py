"""The sparse wire codec of low-communication rounds (`--wire-codec sparse`): top-k of the pseudo-gradient plus the
node's error feedback, sent as positions and 8-bit values, and the average every member computes from the same
payloads.

SparseLoCo (templar) is the anchor: each node keeps the largest `fraction` of every tensor of (pseudo-gradient +
what it has not sent yet) and carries the rest in its error-feedback buffer (`lowcomm.rounds.InnerRounds`), so
nothing is dropped, only sent later. The kept values are quantized before they are offered (`quantize`), so the
quantization error stays in the error feedback like everything else not sent. Every member decodes the same bytes
and sums them in fp32 in the group's order, so the average, and the outer step after it, are the same bits on every
node, and the parameters need no averaging after the round.

Quantization is a shared exponent per block of BLOCK consecutive kept values (in the model's flat order) and an int8
per value: value = q * 2^e, |q| <= 127, e the smallest exponent with every |value| <= 127.5 * 2^e. Every quantized
value is exact in fp32, a value quantizes to itself, so does one a last bit away (hivemind's accumulator scales an
offer by n and 1/n), and a kept value never quantizes to 0 (|q| >= 1), so the positions of an offer are those of its
payload.

Payload layout (little-endian): magic `DSPR`, u32 count, u8 positions layout, u8 value type, the positions, then the
values. Positions are either `count` u32 flat indices (strictly increasing, below the model's element count) or a
bitmask of the model's elements (bit i of byte i // 8, padding bits 0), whichever is smaller: at top-10% the bitmask
costs 1/8 byte per element where indices cost 4/10. Only the smaller layout is accepted, so a set of positions has
one encoding and a payload one bound. Values are `count` f32 (finite), or, as quantized (I8), ceil(count / BLOCK)
int8 exponents in [-E_MAX, E_MAX] then `count` int8 in [-127, 127]: at top-10% a round costs 0.23 bytes per model
element. Everything a stranger sends is checked before it is used.
"""
from __future__ import annotations

import math
import struct
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

MAGIC = b"DSPR"
HEADER = struct.Struct("<4sIBB")
INDICES, BITMASK = 0, 1  # positions layouts
F32, I8 = 0, 2  # value types
BLOCK = 64  # kept values per shared exponent
E_MAX = 120  # |exponent| bound: 127 * 2^120 is a finite fp32, 2^-120 a normal one


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


def values_bytes(count: int, quantized: bool) -> int:
    return count + -(-count // BLOCK) if quantized else 4 * count


def payload_bytes(count: int, total: int, quantized: bool) -> int:
    """Size of a payload of `count` elements of a `total`-element model (the bound of one carrying at most `count`)."""
    return HEADER.size + positions_bytes(count, total) + values_bytes(count, quantized)


def bytes_per_element(fraction: float, quantized: bool = True) -> float:
    """Wire bytes per model element of one payload (what the round deadlines are derived from)."""
    return min(4 * fraction, 1 / 8) + fraction * ((1 + 1 / BLOCK) if quantized else 4)


def top_k_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the `k` largest of flat `magnitudes` (ties: the lower index), in increasing order.

    On the CPU, a partition finds the k-th largest value and one pass keeps what is above it and the first ties at
    it: positions come out in order, with no sort (a tenth of topk-then-sort's time for the default model's
    embedding, on one core). Elsewhere (a device's tensors), and for magnitudes that are not all numbers, topk."""
    n = magnitudes.numel()
    if not k:
        return torch.zeros(0, dtype=torch.int64)
    if k >= n:
        return torch.arange(n)
    if magnitudes.device.type == "cpu" and magnitudes.dtype in (torch.float32, torch.float64):
        arr = magnitudes.detach().reshape(-1).numpy()
        threshold = np.partition(arr, n - k)[n - k]
        at_least = np.flatnonzero(arr >= threshold)
        if at_least.size > k:  # ties at the threshold: the first ones (lowest positions) stay
            tie = arr[at_least] == threshold
            spare = k - (at_least.size - int(tie.sum()))
            at_least = at_least[~tie | (np.cumsum(tie) <= spare)]
        if at_least.size == k:  # else NaNs, which compare false
            return torch.from_numpy(at_least)
    return torch.topk(magnitudes, k, sorted=False).indices.sort().values


@torch.no_grad()
def top_k(tensors: Sequence[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    """Each tensor with all but its `kept` largest-magnitude elements set to 0 (ties: the lower index)."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        sparse = torch.zeros_like(flat)
        idx = top_k_indices(flat.abs(), kept(flat.numel(), fraction))
        sparse[idx] = flat[idx]
        out.append(sparse.view_as(t))
    return out


CHUNK = BLOCK * 16384  # values quantized at once: blocks are independent, so chunks bound the float64 temporaries


def _quantize_values(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exponent per block, int8 per value) of fp32 `values`, all non-zero."""
    if values.size > CHUNK:
        parts = [_quantize_chunk(values[i:i + CHUNK]) for i in range(0, values.size, CHUNK)]
        return np.concatenate([e for e, _ in parts]), np.concatenate([q for _, q in parts])
    return _quantize_chunk(values)


def _quantize_chunk(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    blocks = -(-values.size // BLOCK)
    padded = np.zeros(blocks * BLOCK, np.float32)
    padded[:values.size] = np.abs(values)
    peak = padded.reshape(blocks, BLOCK).max(axis=1).astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(peak / 127.5))
    e = np.clip(np.nan_to_num(e, neginf=-E_MAX), -E_MAX, E_MAX)
    e = np.where(peak > 127.5 * np.exp2(e), e + 1, e)  # log2 a last bit off: the smallest e that fits
    e = np.where((e > -E_MAX) & (peak <= 127.5 * np.exp2(e - 1)), e - 1, e)
    e = np.clip(e, -E_MAX, E_MAX).astype(np.int8)
    scale = np.exp2(np.repeat(e.astype(np.float64), BLOCK)[:values.size])
    q = np.clip(np.rint(np.abs(values) / scale), 1, 127) * np.sign(values)
    return e, q.astype(np.int8)


def _dequantize(e: np.ndarray, q: np.ndarray) -> np.ndarray:
    out = np.empty(q.size, np.float32)
    for i in range(0, q.size, CHUNK):
        chunk = q[i:i + CHUNK]
        exponents = np.repeat(e[i // BLOCK:(i + CHUNK) // BLOCK].astype(np.int32), BLOCK)[:chunk.size]
        out[i:i + chunk.size] = np.ldexp(chunk.astype(np.float32), exponents)
    return out


@torch.no_grad()
def quantize(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` with their non-zero values as a payload carries them (blocks in the flat order of the list)."""
    out = quantize_([t.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True) for t in tensors])
    return [q.to(t.dtype) for q, t in zip(out, tensors)]


@torch.no_grad()
def quantize_(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`quantize` in place on fp32 tensors (returns them). Only the kept values are gathered into one array, never
    the whole model (a round's offer is a small fraction of it)."""
    parts = [t.view(-1).numpy() for t in tensors]
    positions = [np.flatnonzero(part) for part in parts]
    values = _dequantize(*_quantize_values(np.concatenate([part[i] for part, i in zip(parts, positions)])))
    offset = 0
    for part, idx in zip(parts, positions):
        part[idx] = values[offset:offset + idx.size]
        offset += idx.size
    return list(tensors)


def encode(flat, quantized: bool = False) -> bytes:
    """The non-zero elements of a flat fp32 tensor, or of a sequence of tensors in their flat order, as a payload;
    `quantized`: 8-bit values (`quantize`; a node's offer is quantized before it is offered, so this changes nothing
    of it and the error is in its feedback). The tensors are read one at a time: besides the payload, it holds a
    byte per element (the positions) and the kept values, not a copy of the model."""
    parts = [flat] if isinstance(flat, torch.Tensor) else list(flat)
    parts = [t.detach().reshape(-1).to(torch.float32).numpy() for t in parts]
    total = sum(part.size for part in parts)
    marks = np.empty(total, dtype=bool)
    offset = 0
    for part in parts:
        np.not_equal(part, 0, out=marks[offset:offset + part.size])
        offset += part.size
    count = int(np.count_nonzero(marks))
    values = np.empty(count, dtype="<f4")
    offset, kept = 0, 0
    for part in parts:
        kept_here = part[marks[offset:offset + part.size]]
        values[kept:kept + kept_here.size] = kept_here
        offset, kept = offset + part.size, kept + kept_here.size
    if (total + 7) // 8 < 4 * count:
        layout, positions = BITMASK, np.packbits(marks, bitorder="little")
    else:
        layout, positions = INDICES, np.flatnonzero(marks).astype("<u4")
    del marks
    return _assemble(layout, positions, values, quantized)


UNPACK_BYTES = 1 << 22  # bitmask bytes unpacked at once: positions are found without a byte per model element


class PayloadBuilder:
    """`encode` of a model given tensor by tensor as the positions (increasing, within the tensor) and values of its
    non-zero elements, in the model's order: the same bytes, holding the bitmask (1/8 byte per model element) and
    the values, never a byte per element or the dense tensors (a sparse offer: node.lowcomm.rounds)."""

    def __init__(self, total: int, max_count: int):
        self.total = total
        # surely indices (smaller than any bitmask): kept as they come; else the bitmask, turned into indices at the
        # end if the values came fewer than expected
        self._indices = 4 * max_count <= (total + 7) // 8
        self._positions: list[np.ndarray] = []
        self._bits = None if self._indices else np.zeros((total + 7) // 8, np.uint8)
        self._values = np.empty(max_count, np.float32)
        self._offset = self._count = 0

    def add(self, positions: np.ndarray, values: np.ndarray, numel: int) -> None:
        at = positions.astype(np.int64) + self._offset
        if self._indices:
            self._positions.append(at.astype("<u4"))
        elif at.size:
            byte, bit = at >> 3, (1 << (at & 7)).astype(np.uint8)
            starts = np.flatnonzero(np.r_[True, byte[1:] != byte[:-1]])
            self._bits[byte[starts]] |= np.add.reduceat(bit, starts).astype(np.uint8)  # a byte may span tensors
        self._values[self._count:self._count + values.size] = values
        self._count += values.size
        self._offset += numel

    @property
    def values(self) -> np.ndarray:
        """The values added so far, in order (writable: `quantize_` them before `payload`)."""
        return self._values[:self._count]

    def payload(self, quantized: bool = False) -> bytes:
        count = self._count
        if self._indices:
            layout, positions = INDICES, np.concatenate(self._positions) if self._positions else np.zeros(0, "<u4")
        elif (self.total + 7) // 8 < 4 * count:
            layout, positions = BITMASK, self._bits
        else:
            layout, positions = INDICES, _marked(self._bits, self.total, count, np.dtype("<u4"))
        return _assemble(layout, positions, self.values.astype("<f4", copy=False), quantized)


def _marked(mask: np.ndarray, total: int, count: int, dtype: np.dtype) -> np.ndarray:
    """The `count` positions a bitmask of a `total`-element model marks, unpacked a piece at a time (BadPayload if it
    marks another count, or padding bits)."""
    positions, found = np.empty(count, dtype), 0
    for start in range(0, mask.size, UNPACK_BYTES):
        bits = np.unpackbits(mask[start:start + UNPACK_BYTES], bitorder="little")
        first = 8 * start
        if first + bits.size > total and bits[max(total - first, 0):].any():
            raise BadPayload(f"the bitmask marks elements at or past {total}")
        here = np.flatnonzero(bits[:max(total - first, 0)])
        if found + here.size > count:
            raise BadPayload(f"the bitmask marks more than the {count} elements the header says")
        positions[found:found + here.size] = here + first
        found += here.size
    if found != count:
        raise BadPayload(f"the bitmask marks {found} elements, the header says {count}")
    return positions


def _assemble(layout: int, positions: np.ndarray, values: np.ndarray, quantized: bool) -> bytes:
    """The payload: header, `positions` in `layout`, then `values` (f32, or 8-bit if `quantized`)."""
    if quantized:
        e, q = _quantize_values(values)
        wire = [e, q]
    else:
        wire = [values]
    header = HEADER.pack(MAGIC, values.size, layout, I8 if quantized else F32)
    return b"".join([header, memoryview(positions).cast("B"), *(memoryview(w).cast("B") for w in wire)])


def index_dtype(total: int) -> torch.dtype:
    """The positions of a `total`-element model: int32 while they fit (half the bytes of int64)."""
    return torch.int32 if total <= 2 ** 31 - 1 else torch.int64


def decode(data: bytes, total: int, limit: int, quantized: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values f32) of a payload for a model of `total` elements carrying at most `limit` of them, with
    8-bit values if `quantized` else fp32. Indices are `index_dtype(total)` (int32 for any model under 2^31
    elements), increasing; decoding holds them and the values, 8 bytes per element carried, and a bounded piece of
    the bitmask at a time."""
    if len(data) < HEADER.size:
        raise BadPayload(f"a payload of {len(data)} bytes has no header")
    magic, count, layout, kind = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadPayload(f"not a sparse payload (magic {magic!r})")
    if count > limit:
        raise BadPayload(f"{count} elements, more than the {limit} a round sends")
    if kind != (I8 if quantized else F32):
        raise BadPayload(f"value type {kind}, expected {'i8' if quantized else 'f32'}")
    want_layout = BITMASK if (total + 7) // 8 < 4 * count else INDICES
    if layout != want_layout:
        raise BadPayload(f"positions layout {layout} where the smaller one ({want_layout}) is due")
    expected = payload_bytes(count, total, quantized)
    if len(data) != expected:
        raise BadPayload(f"{len(data)} bytes for {count} elements (expected {expected})")
    pos_end = HEADER.size + positions_bytes(count, total)
    np_index = np.int32 if index_dtype(total) == torch.int32 else np.int64
    if layout == BITMASK:
        idx = _marked(np.frombuffer(data, np.uint8, pos_end - HEADER.size, HEADER.size), total, count,
                      np.dtype(np_index))
    else:
        raw = np.frombuffer(data, "<u4", count, HEADER.size)
        if count and (int(raw[-1]) >= total or not np.all(raw[1:] > raw[:-1])):
            raise BadPayload(f"indices must increase strictly and stay below {total}")
        idx = raw.astype(np_index)
    if quantized:
        blocks = -(-count // BLOCK)
        e = np.frombuffer(data, np.int8, blocks, pos_end)
        q = np.frombuffer(data, np.int8, count, pos_end + blocks)
        if np.any(np.abs(e.astype(np.int32)) > E_MAX):
            raise BadPayload(f"a block exponent outside [-{E_MAX}, {E_MAX}]")
        if np.any(q == -128):
            raise BadPayload("an 8-bit value of -128 (values are in [-127, 127])")
        values = _dequantize(e, q)
    else:
        values = np.frombuffer(data, "<f4", count, pos_end).astype(np.float32)
        if not np.all(np.isfinite(values)):
            raise BadPayload("values must be finite")
    return torch.from_numpy(idx), torch.from_numpy(values)


def decode_tensors(data: bytes, sizes: Sequence[int], quantized: bool = False) -> Iterator[tuple[np.ndarray,
                                                                                             np.ndarray]]:
    """Per tensor of a model of `sizes`, in order: (positions within it, int64; values f32) of a payload this node
    made itself (its offer: node.lowcomm.rounds), decoded a tensor at a time, so that nothing the size of the
    payload's positions or values is held. Its header is checked; its positions and values are as `encode` wrote
    them (a stranger's payload goes through `decode`)."""
    total = sum(sizes)
    if len(data) < HEADER.size:
        raise BadPayload(f"a payload of {len(data)} bytes has no header")
    magic, count, layout, kind = HEADER.unpack_from(data)
    if magic != MAGIC or kind != (I8 if quantized else F32) or len(data) != payload_bytes(count, total, quantized) \
            or layout != (BITMASK if (total + 7) // 8 < 4 * count else INDICES):
        raise BadPayload(f"not a payload of this model ({len(data)} bytes, {count} elements, layout {layout})")
    pos_end = HEADER.size + positions_bytes(count, total)
    if layout == BITMASK:
        mask = np.frombuffer(data, np.uint8, pos_end - HEADER.size, HEADER.size)
    else:
        raw = np.frombuffer(data, "<u4", count, HEADER.size)
    if quantized:
        blocks = -(-count // BLOCK)
        e = np.frombuffer(data, np.int8, blocks, pos_end)
        q = np.frombuffer(data, np.int8, count, pos_end + blocks)
    else:
        f32 = np.frombuffer(data, "<f4", count, pos_end)
    start, kept = 0, 0
    for n in sizes:
        if layout == BITMASK:
            first = start // 8
            bits = np.unpackbits(mask[first:(start + n + 7) // 8], bitorder="little")
            local = np.flatnonzero(bits[start - 8 * first:start - 8 * first + n])
        else:
            lo, hi = np.searchsorted(raw, [start, start + n])
            local = raw[lo:hi].astype(np.int64) - start
        end = kept + local.size
        if quantized:  # as _dequantize: each value times 2 ** its block's exponent
            exponents = e[np.arange(kept, end) // BLOCK].astype(np.int32)
            values = np.ldexp(q[kept:end].astype(np.float32), exponents)
        else:
            values = f32[kept:end].astype(np.float32)
        yield local, values
        start, kept = start + n, end


def average(payloads: Iterable[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float],
            total: int) -> torch.Tensor:
    """The weighted mean of decoded payloads as a flat fp32 tensor: the same bits for the same payloads, weights and
    order on every machine (one element-wise pass per payload, in the given order). `payloads` may be a generator
    that decodes each one as it comes: a round then holds one member's indices and values at a time, not all."""
    out = torch.zeros(total, dtype=torch.float32)
    average_into(payloads, weights, [out])
    return out


def average_into(payloads: Iterable[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float],
                 out: Sequence[torch.Tensor]) -> None:
    """`average` written into `out`, fp32 tensors that together are the model in its flat order (a round's
    `.grad`): the same bits, and no flat copy of the model. Each payload's sorted indices are cut at the tensors'
    bounds, so every element gets the same additions in the same order."""
    weights = list(weights)
    if not weights:
        raise ValueError("one weight per payload, at least one payload")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {weights}")
    norm = float(sum(weights))
    flats = [t.view(-1) for t in out]
    for flat in flats:
        flat.zero_()
    bounds = np.cumsum([0] + [flat.numel() for flat in flats])
    count = 0
    for idx, values in payloads:  # every payload is read (and checked, when decoded here) even if norm is 0
        if count == len(weights):
            raise ValueError("one weight per payload, more payloads than weights")
        if norm:
            weight = np.float32(weights[count] / norm)
            cuts = torch.searchsorted(idx, torch.tensor(bounds, dtype=idx.dtype)).tolist()  # indices increase
            for flat, start, lo, hi in zip(flats, bounds.tolist(), cuts, cuts[1:]):
                if hi > lo:  # scaled a tensor's values at a time: no scaled copy of the whole payload
                    flat.index_add_(0, idx[lo:hi] - start, values[lo:hi] * weight)
        count += 1
    if count != len(weights):
        raise ValueError(f"one weight per payload: {count} payloads for {len(weights)} weights")
