"""A sparse swarm's state cut into ranges that a joiner downloads from several donors at once
(docs/low-communication.md, "Joining from several donors"): the plan, the wire format of one range and its checks,
and the assembly of ranges of different epochs into one state. Pure: no network, no node.

The state of epoch e is the same bytes on every node of a sparse swarm: the parameters and the outer Nesterov
momentum in 8 bits (node.lowcomm.gather, node.lowcomm.momentum). A range is `length` consecutive elements of the
model's flat parameter order, starting at `offset`, with both its parameters and its momentum; it begins and ends
on a momentum block's boundary (`StateLayout`), so it carries its blocks' scales whole. The outer step is elementwise
and the momentum's rounding blockwise, so a range of epoch e and the averages of rounds e+1..E (from their records:
node.lowcomm.roundlog) give that range of epoch E exactly (`StateLayout.bring_forward`), and ranges that came from
donors at different epochs assemble into one state of the newest.

Request (little-endian): u64 offset, u32 length. Answer: u64 epoch, u64 offset, u32 length, then `length` f32
parameters, the range's f32 momentum scales (one per block) and its `length` int8 momentum codes: 5 bytes per
element and 4 per 256.
"""
from __future__ import annotations

import bisect
import struct
from typing import Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch

from dtrain.node.lowcomm import momentum as momentum8
from dtrain.node.lowcomm.outer import nesterov_

RANGE_ELEMENTS = 1 << 16  # elements per range: 320 KiB on the wire, a fraction of a second at a home uplink
MAX_RANGE_ELEMENTS = 1 << 20  # the most a donor answers for one request (5 MiB)
REQUEST = struct.Struct("<QI")  # offset, length
HEADER = struct.Struct("<QQI")  # epoch, offset, length
BYTES_PER_ELEMENT = momentum8.STATE_BYTES_PER_ELEMENT  # a range's parameter, momentum code and share of a scale


class BadRange(ValueError):
    """A request or an answer that is not a range of this model's state in this format."""


class Range(NamedTuple):
    offset: int  # the first element, in the model's flat parameter order
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class Piece(NamedTuple):
    """One range of the state as it was at `epoch`."""

    epoch: int
    params: np.ndarray  # float32 [length]
    codes: np.ndarray  # int8 [length]: the momentum's codes
    scales: np.ndarray  # float32 [the range's blocks]: their scales


class Part(NamedTuple):
    """The share of a range in one tensor: its elements [lo, hi) of tensor `tensor`, which begin on a block."""

    tensor: int
    lo: int
    hi: int

    @property
    def first_scale(self) -> int:
        return self.lo // momentum8.BLOCK

    @property
    def end_scale(self) -> int:
        return momentum8.blocks(self.hi)


def encode_request(r: Range) -> bytes:
    return REQUEST.pack(r.offset, r.length)


def encode_piece(r: Range, piece: Piece) -> bytes:
    return (HEADER.pack(piece.epoch, r.offset, r.length) + np.ascontiguousarray(piece.params, "<f4").tobytes()
            + np.ascontiguousarray(piece.scales, "<f4").tobytes() + np.ascontiguousarray(piece.codes, "i1").tobytes())


class StateLayout:
    """The model's tensors (`sizes`: each tensor's elements, in the flat order) as ranges of whole momentum blocks:
    where ranges may begin and end, what each holds, its answer's bytes and checks, and the outer step on a range."""

    def __init__(self, sizes: Sequence[int]):
        self.sizes = tuple(int(n) for n in sizes)
        self.starts = tuple(np.cumsum((0,) + self.sizes[:-1]).tolist()) if self.sizes else ()
        self.total = sum(self.sizes)

    def _tensor_at(self, x: int) -> int:
        """The tensor that holds element `x` (< total)."""
        return bisect.bisect_right(self.starts, x) - 1

    def on_boundary(self, x: int) -> bool:
        """Element `x` begins a block of its tensor (or is the end of the state)."""
        if x == self.total:
            return True
        return 0 <= x < self.total and (x - self.starts[self._tensor_at(x)]) % momentum8.BLOCK == 0

    def plan(self, range_elements: int = RANGE_ELEMENTS) -> list[Range]:
        """The ranges that cover the state, in order: each ends on the last block boundary within `range_elements`
        of its start (a range shorter than one block is that block)."""
        if range_elements < 1:
            raise ValueError(f"range_elements must be >= 1, got {range_elements}")
        out, s = [], 0
        while s < self.total:
            x = s + range_elements
            if x >= self.total:
                end = self.total
            else:
                t = self._tensor_at(x)
                end = self.starts[t] + (x - self.starts[t]) // momentum8.BLOCK * momentum8.BLOCK
                if end <= s:  # the block `s` begins
                    t = self._tensor_at(s)
                    end = min(s + momentum8.BLOCK, self.starts[t] + self.sizes[t])
            out.append(Range(s, end - s))
            s = end
        return out

    def parts(self, r: Range) -> list[Part]:
        out, t = [], self._tensor_at(r.offset)
        while t < len(self.sizes) and self.starts[t] < r.end:
            lo, hi = max(r.offset, self.starts[t]) - self.starts[t], min(r.end, self.starts[t] + self.sizes[t])
            if hi - self.starts[t] > lo:
                out.append(Part(t, lo, hi - self.starts[t]))
            t += 1
        return out

    def spans(self, r: Range) -> Iterator[tuple[Part, slice, slice]]:
        """Each part of `r`, with where its elements and its scales are in a piece of `r`."""
        at, scale_at = 0, 0
        for part in self.parts(r):
            n, k = part.hi - part.lo, part.end_scale - part.first_scale
            yield part, slice(at, at + n), slice(scale_at, scale_at + k)
            at, scale_at = at + n, scale_at + k

    def scale_count(self, r: Range) -> int:
        return sum(part.end_scale - part.first_scale for part in self.parts(r))

    def answer_bytes(self, r: Range) -> int:
        return HEADER.size + 5 * r.length + 4 * self.scale_count(r)

    def parse_request(self, data: bytes) -> Range:
        """A donor's check of what it is asked: one range of whole blocks inside the model, at most
        MAX_RANGE_ELEMENTS long."""
        if len(data) != REQUEST.size:
            raise BadRange(f"a request of {len(data)} bytes, not {REQUEST.size}")
        r = Range(*REQUEST.unpack(data))
        if not 0 < r.length <= MAX_RANGE_ELEMENTS or r.end > self.total:
            raise BadRange(f"range {r.offset}+{r.length} of a {self.total}-element state (at most "
                           f"{MAX_RANGE_ELEMENTS})")
        if not (self.on_boundary(r.offset) and self.on_boundary(r.end)):
            raise BadRange(f"range {r.offset}+{r.length} does not begin and end on a momentum block")
        return r

    def decode_piece(self, data: bytes, want: Range, min_epoch: int, max_epoch: int) -> Piece:
        """The answer to `want`, checked: its header names that range and an epoch in [min_epoch, max_epoch], its
        size is exactly the range's, every parameter finite, every scale finite, >= 0 and finite times 127, every
        code in [-127, 127]."""
        if len(data) != self.answer_bytes(want):
            raise BadRange(f"{len(data)} bytes for range {want.offset}+{want.length}, not {self.answer_bytes(want)}")
        epoch, offset, length = HEADER.unpack_from(data)
        if (offset, length) != want:
            raise BadRange(f"range {offset}+{length} where {want.offset}+{want.length} was asked")
        if not min_epoch <= epoch <= max_epoch:
            raise BadRange(f"epoch {epoch} outside [{min_epoch}, {max_epoch}]")
        n_scales = self.scale_count(want)
        params = np.frombuffer(data, "<f4", count=length, offset=HEADER.size).astype(np.float32)
        scales = np.frombuffer(data, "<f4", count=n_scales, offset=HEADER.size + 4 * length).astype(np.float32)
        codes = np.frombuffer(data, "i1", count=length, offset=HEADER.size + 4 * (length + n_scales)).copy()
        if not np.isfinite(params).all():
            raise BadRange(f"range {offset}+{length} of epoch {epoch} holds non-finite parameters")
        with np.errstate(over="ignore"):
            if not (np.isfinite(scales * np.float32(momentum8.LEVELS)).all() and (scales >= 0).all()):
                raise BadRange(f"range {offset}+{length} of epoch {epoch} holds momentum scales that are not "
                               f"finite and >= 0")
        if (codes < -momentum8.LEVELS).any():
            raise BadRange(f"range {offset}+{length} of epoch {epoch} holds a momentum code below "
                           f"-{momentum8.LEVELS}")
        return Piece(epoch, params, codes, scales)

    @torch.no_grad()
    def bring_forward(self, r: Range, piece: Piece, averages: Sequence[tuple[int, torch.Tensor]], lr: float,
                      momentum: float) -> Piece:
        """`piece` of range `r` at the epoch of the last of `averages` ((epoch, the round's average over the whole
        model, flat f32), epochs piece.epoch + 1, + 2, ...) applied to the range alone with the outer Nesterov step,
        the same operations the swarm's update made on the whole tensors, block by block."""
        epoch = piece.epoch
        p = torch.from_numpy(piece.params.copy())
        codes, scales = torch.from_numpy(piece.codes.copy()), torch.from_numpy(piece.scales.copy())
        for round_epoch, average in averages:
            if round_epoch != epoch + 1:
                raise ValueError(f"round {round_epoch} applied to a range of epoch {epoch}")
            for _, elements, kept in self.spans(r):
                nesterov_(p[elements], average[r.offset:r.end][elements], codes[elements], scales[kept], lr,
                          momentum)
            epoch = round_epoch
        return Piece(epoch, p.numpy(), codes.numpy(), scales.numpy())


class Assembly:
    """The pieces received so far of the state of `layout`, each tagged with the epoch it came from."""

    def __init__(self, layout: StateLayout, range_elements: int = RANGE_ELEMENTS):
        self.layout = layout
        self.total = layout.total
        self.ranges = layout.plan(range_elements)
        self._planned = frozenset(self.ranges)
        self.pieces: dict[Range, Piece] = {}

    def add(self, r: Range, piece: Piece) -> None:
        if r not in self._planned or len(piece.params) != r.length or len(piece.codes) != r.length or \
                len(piece.scales) != self.layout.scale_count(r):
            raise ValueError(f"range {r} is not in the plan, or its piece is another size")
        self.pieces[r] = piece

    def missing(self) -> list[Range]:
        return [r for r in self.ranges if r not in self.pieces]

    def newest(self) -> Optional[int]:
        return max((p.epoch for p in self.pieces.values()), default=None)

    def oldest(self) -> Optional[int]:
        return min((p.epoch for p in self.pieces.values()), default=None)

    def drop_before(self, epoch: int) -> int:
        """Forget pieces older than `epoch` (to be downloaded again); returns how many."""
        old = [r for r, p in self.pieces.items() if p.epoch < epoch]
        for r in old:
            del self.pieces[r]
        return len(old)

    def bring_forward(self, rounds: Sequence, limit: int, lr: float, momentum: float) -> None:
        """Every piece older than the last of `rounds` (node.lowcomm.roundlog.Round, consecutive, covering every
        such piece's later epochs; `limit`: the elements of a member's payload) brought to that epoch. Each round's
        average is computed once (one flat f32 copy of the model at a time) and applied to every piece that is at
        the epoch before it."""
        if not rounds:
            return
        first, last = rounds[0].epoch, rounds[-1].epoch
        for r, piece in self.pieces.items():
            if piece.epoch < last and piece.epoch + 1 < first:
                raise ValueError(f"range {r} is of epoch {piece.epoch}; the rounds begin at {first}")
        average = torch.empty(self.total, dtype=torch.float32)
        for rnd in rounds:
            rnd.average_into([average], self.total, limit)
            for r, piece in list(self.pieces.items()):
                if piece.epoch == rnd.epoch - 1:
                    self.pieces[r] = self.layout.bring_forward(r, piece, [(rnd.epoch, average)], lr, momentum)

    def load_into(self, params: Sequence[torch.Tensor], codes: Sequence[torch.Tensor],
                  scales: Sequence[torch.Tensor]) -> int:
        """Write the whole state, every piece of one epoch, into the tensors (the model's parameters, their momentum
        codes and scales); returns that epoch."""
        epochs = {p.epoch for p in self.pieces.values()}
        if self.missing() or len(epochs) != 1:
            raise ValueError(f"{len(self.missing())} ranges missing, epochs {sorted(epochs)}: not one state")
        if [p.numel() for p in params] != list(self.layout.sizes) or [c.numel() for c in codes] != \
                list(self.layout.sizes) or [s.numel() for s in scales] != [momentum8.blocks(n) for n in
                                                                           self.layout.sizes]:
            raise ValueError(f"tensors of another shape than the state of {self.total} elements")
        flat_p, flat_c = [p.detach().view(-1) for p in params], [c.view(-1) for c in codes]
        with torch.no_grad():
            for r, piece in self.pieces.items():
                for part, elements, kept in self.layout.spans(r):
                    flat_p[part.tensor][part.lo:part.hi] = torch.from_numpy(piece.params[elements])
                    flat_c[part.tensor][part.lo:part.hi] = torch.from_numpy(piece.codes[elements])
                    scales[part.tensor][part.first_scale:part.end_scale] = torch.from_numpy(piece.scales[kept])
        return epochs.pop()
