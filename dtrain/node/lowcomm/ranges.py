"""A sparse swarm's state cut into ranges that a joiner downloads from several donors at once
(docs/low-communication.md, "Joining from several donors"): the plan, the wire format of one range and its checks,
and the assembly of ranges of different epochs into one state. Pure: no network, no node.

The state of epoch e is the same bytes on every node of a sparse swarm: the parameters and the outer Nesterov
momentum (node.lowcomm.gather). A range is `length` consecutive elements of the model's flat parameter order,
starting at `offset`, with both its parameters and its momentum: the outer step is elementwise, so a range of epoch
e and the averages of rounds e+1..E (from their records: node.lowcomm.roundlog) give that range of epoch E exactly
(`bring_forward`), and ranges that came from donors at different epochs assemble into one state of the newest.

Request (little-endian): u64 offset, u32 length. Answer: u64 epoch, u64 offset, u32 length, then `length` f32
parameters and `length` f32 momentum values.
"""
from __future__ import annotations

import struct
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from dtrain.node.lowcomm.outer import nesterov_

RANGE_ELEMENTS = 1 << 16  # elements per range: 512 KiB on the wire, a fraction of a second at a home uplink
MAX_RANGE_ELEMENTS = 1 << 20  # the most a donor answers for one request (8 MiB)
REQUEST = struct.Struct("<QI")  # offset, length
HEADER = struct.Struct("<QQI")  # epoch, offset, length


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
    momentum: np.ndarray  # float32 [length]


def plan(total: int, range_elements: int = RANGE_ELEMENTS) -> list[Range]:
    """The ranges that cover a state of `total` elements, in order, each `range_elements` long but the last."""
    if range_elements < 1:
        raise ValueError(f"range_elements must be >= 1, got {range_elements}")
    return [Range(o, min(range_elements, total - o)) for o in range(0, total, range_elements)]


def encode_request(r: Range) -> bytes:
    return REQUEST.pack(r.offset, r.length)


def parse_request(data: bytes, total: int) -> Range:
    """A donor's check of what it is asked: one range inside the model, at most MAX_RANGE_ELEMENTS long."""
    if len(data) != REQUEST.size:
        raise BadRange(f"a request of {len(data)} bytes, not {REQUEST.size}")
    r = Range(*REQUEST.unpack(data))
    if not 0 < r.length <= MAX_RANGE_ELEMENTS or r.end > total:
        raise BadRange(f"range {r.offset}+{r.length} of a {total}-element state (at most {MAX_RANGE_ELEMENTS})")
    return r


def encode_piece(r: Range, piece: Piece) -> bytes:
    return (HEADER.pack(piece.epoch, r.offset, r.length) + np.ascontiguousarray(piece.params, "<f4").tobytes()
            + np.ascontiguousarray(piece.momentum, "<f4").tobytes())


def answer_bytes(r: Range) -> int:
    return HEADER.size + 8 * r.length


def decode_piece(data: bytes, want: Range, min_epoch: int, max_epoch: int) -> Piece:
    """The answer to `want`, checked: its header names that range and an epoch in [min_epoch, max_epoch], its size is
    exactly the range's, every value finite."""
    if len(data) != answer_bytes(want):
        raise BadRange(f"{len(data)} bytes for range {want.offset}+{want.length}, not {answer_bytes(want)}")
    epoch, offset, length = HEADER.unpack_from(data)
    if (offset, length) != want:
        raise BadRange(f"range {offset}+{length} where {want.offset}+{want.length} was asked")
    if not min_epoch <= epoch <= max_epoch:
        raise BadRange(f"epoch {epoch} outside [{min_epoch}, {max_epoch}]")
    values = np.frombuffer(data, "<f4", count=2 * length, offset=HEADER.size).astype(np.float32)
    if not np.isfinite(values).all():
        raise BadRange(f"range {offset}+{length} of epoch {epoch} holds non-finite values")
    return Piece(epoch, values[:length], values[length:])


@torch.no_grad()
def bring_forward(r: Range, piece: Piece, averages: Sequence[tuple[int, torch.Tensor]], lr: float,
                  momentum: float) -> Piece:
    """`piece` of range `r` at the epoch of the last of `averages` ((epoch, the round's average over the whole model,
    flat f32), epochs piece.epoch + 1, + 2, ...) applied to the range alone with the outer Nesterov step, the same
    operations the swarm's update made on the whole tensors."""
    epoch = piece.epoch
    p, buf = torch.from_numpy(piece.params.copy()), torch.from_numpy(piece.momentum.copy())
    for round_epoch, average in averages:
        if round_epoch != epoch + 1:
            raise ValueError(f"round {round_epoch} applied to a range of epoch {epoch}")
        nesterov_(p, average[r.offset:r.end], buf, lr, momentum)
        epoch = round_epoch
    return Piece(epoch, p.numpy(), buf.numpy())


class Assembly:
    """The pieces received so far of a state of `total` elements, each tagged with the epoch it came from."""

    def __init__(self, total: int, range_elements: int = RANGE_ELEMENTS):
        self.total = total
        self.ranges = plan(total, range_elements)
        self._planned = frozenset(self.ranges)
        self.pieces: dict[Range, Piece] = {}

    def add(self, r: Range, piece: Piece) -> None:
        if r not in self._planned or len(piece.params) != r.length or len(piece.momentum) != r.length:
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
                    self.pieces[r] = bring_forward(r, piece, [(rnd.epoch, average)], lr, momentum)

    def load_into(self, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> int:
        """Write the whole state, every piece of one epoch, into the tensors (the model's flat order); returns that
        epoch."""
        epochs = {p.epoch for p in self.pieces.values()}
        if self.missing() or len(epochs) != 1:
            raise ValueError(f"{len(self.missing())} ranges missing, epochs {sorted(epochs)}: not one state")
        if sum(p.numel() for p in params) != self.total or [p.numel() for p in params] != [m.numel() for m in momentum]:
            raise ValueError(f"tensors of another shape than a {self.total}-element state")
        flat_p, flat_m = np.empty(self.total, np.float32), np.empty(self.total, np.float32)
        for r, piece in self.pieces.items():
            flat_p[r.offset:r.end], flat_m[r.offset:r.end] = piece.params, piece.momentum
        with torch.no_grad():
            start = 0
            for p, m in zip(params, momentum):
                n = p.numel()
                p.copy_(torch.from_numpy(flat_p[start:start + n]).view_as(p))
                m.copy_(torch.from_numpy(flat_m[start:start + n]).view_as(m))
                start += n
        return epochs.pop()
