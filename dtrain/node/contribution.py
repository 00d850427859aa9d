"""What crosses the seam from the bridge into the node: one contributor's gradient for one step.

The bridge decodes a DGRD packet, validates every number in it, and hands the node a `Contribution`; the node
owns everything after that (weighting, pooling, accumulation). Pure numpy, no hivemind or web import.
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch


@dataclass(frozen=True)
class Section:
    """The gradient of one tensor: dense (`indices is None`, one value per element) or sparse."""

    tensor_id: int
    indices: Optional[np.ndarray]  # int64 flat element indices; None: dense
    values: np.ndarray  # float32 per index; a dense section may hold float16 (Mode 3 as it came off the wire)
    unique: bool = False  # indices strictly increasing (DGRD Mode 2): a plain indexed add, no np.add.at

    @property
    def nbytes(self) -> int:
        """Bytes its arrays span (views of a packet: the packet's bytes they keep alive)."""
        return self.values.nbytes + (0 if self.indices is None else self.indices.nbytes)


class LazySection:
    """A sparse Section whose int64 indices and float32 values are made on first read, then kept.

    The bridge validates a packet on the request path with reductions over its bytes and hands its sparse sections
    over as they lie in the packet; whoever reads `indices` or `values` first (the training thread, when it
    aggregates) widens them, once. Until then it holds only `nbytes` of the packet. Reads like a `Section`.
    """

    __slots__ = ("tensor_id", "unique", "nbytes", "_make", "_arrays")

    def __init__(self, tensor_id: int, unique: bool, nbytes: int,
                 make: Callable[[], tuple[np.ndarray, np.ndarray]]):
        self.tensor_id, self.unique, self.nbytes = tensor_id, unique, nbytes  # nbytes: of the packet, held
        self._make = make  # -> (indices, values)
        self._arrays: Optional[tuple[np.ndarray, np.ndarray]] = None

    @property
    def indices(self) -> np.ndarray:
        return self._widened()[0]

    @property
    def values(self) -> np.ndarray:
        return self._widened()[1]

    def _widened(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:  # two threads reading at once would both make the same arrays: no harm
            self._arrays = self._make()
        return self._arrays


AnySection = Union[Section, LazySection]


class LazySections(SequenceABC):
    """A decoded packet's sections, made by `make` on first read, then kept; `nbytes` is known before.

    The request path that validated a packet builds this one object instead of one per tensor (148 for GPT-2
    small, 0.3 ms of Python per packet); the training thread, which reads the sections, makes them. Reads like a
    tuple of sections.
    """

    __slots__ = ("nbytes", "_make", "_items")

    def __init__(self, nbytes: int, make: Callable[[], tuple[AnySection, ...]]):
        self.nbytes = nbytes  # of the packet, held by the sections
        self._make = make
        self._items: Optional[tuple[AnySection, ...]] = None

    def _made(self) -> tuple[AnySection, ...]:
        if self._items is None:  # two threads reading at once would both make the same sections: no harm
            self._items = self._make()
        return self._items

    def __len__(self) -> int:
        return len(self._made())

    def __getitem__(self, i):
        return self._made()[i]

    def __iter__(self) -> Iterator[AnySection]:
        return iter(self._made())


@dataclass(frozen=True)
class Contribution:
    """One accepted gradient: the mean over `samples` samples of the contributor's loss gradient at `step`."""

    contributor: str  # the packet's node_id
    step: int  # the model step the gradient was computed for
    samples: int  # its weight in the samples-weighted mean
    loss: float  # mean training loss over those samples
    sections: Sequence[AnySection]  # a tuple, or a decoded packet's LazySections
    own: bool = False  # made by this node itself (its feedback training): never judged against its reference

    @property
    def nbytes(self) -> int:
        """Bytes its sections hold as accepted (for a decoded packet: about the packet's size)."""
        if isinstance(self.sections, LazySections):
            return self.sections.nbytes  # without making them
        return sum(s.nbytes for s in self.sections)


def add_sections(accumulators: Sequence[np.ndarray], sections: Sequence[AnySection], weight: float = 1.0) -> None:
    """Add `weight * values` of every section into the flat float32 `accumulators[tensor_id]`.

    The sections must have been validated (ids and bounds) by whoever built them. Dense values may be float16
    (DGRD Mode 3 as it came off the wire): they are converted a chunk at a time as they are added. Each product
    `weight * value` is rounded to float32 before it is added, whatever the path, so every path gives the same
    bits as `acc += w * values`.
    """
    w = np.float32(weight)
    for s in sections:
        acc = accumulators[s.tensor_id]
        if s.indices is None:
            _add_dense(acc, s.values, w)
        else:
            # np.add.at for Mode 2's unique indices too: measured with numpy 2.3, 1.3M entries into GPT-2 small,
            # its read-modify-write loop touches each cache line once (~15 ns per entry, memory-bound at 1%
            # density), where acc[idx] += v gathers and then scatters: two misses per entry, twice the time.
            # Mode 1 may repeat an index and repeats add up; np.bincount(minlength=) would build and add a
            # float64 array of the whole tensor (335 ms for 386k entries into 38.6M elements).
            np.add.at(acc, s.indices, s.values if w == 1 else w * s.values)


# elements converted and added per pass: a 128 KiB float32 scratch that stays in cache, and at torch's grain
# size (32768), so copy_ runs inline on this thread: split across threads it waited on a core that swarm peers or
# the event loop held (0.3 ms per chunk instead of 0.01 on a busy 2-core machine)
DENSE_CHUNK = 1 << 15


def _add_dense(acc: np.ndarray, values: np.ndarray, w: np.float32) -> None:
    """acc += w * values for a whole tensor, without a temporary the size of the tensor.

    float16 goes through torch's copy_, which converts with F16C: numpy casts float16 in software (~7 ns per
    element against ~0.5), which made a dense 170 MB packet spend 0.8 s converting.
    """
    if values.dtype == np.float16:
        # The packet is usually read-only (bytes) and torch refuses to wrap read-only memory without a warning:
        # each chunk is first copied (a memcpy) into a small writable float16 scratch, then converted from there.
        n_scratch = min(values.size, DENSE_CHUNK)
        half, full = np.empty(n_scratch, np.float16), np.empty(n_scratch, np.float32)
        half_t, full_t = torch.from_numpy(half), torch.from_numpy(full)
        for start in range(0, values.size, DENSE_CHUNK):
            n = min(DENSE_CHUNK, values.size - start)
            half[:n] = values[start:start + n]
            full_t[:n].copy_(half_t[:n])
            _add_scaled(acc[start:start + n], full[:n], w)
        return
    for start in range(0, values.size, DENSE_CHUNK):
        _add_scaled(acc[start:start + DENSE_CHUNK], values[start:start + DENSE_CHUNK], w)


def _add_scaled(acc: np.ndarray, values: np.ndarray, w: np.float32) -> None:
    if w == 1:
        np.add(acc, values, out=acc)
    else:
        np.add(acc, np.multiply(values, w), out=acc)
