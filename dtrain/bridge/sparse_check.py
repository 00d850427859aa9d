"""The sparse sections of a whole packet checked at once: every value finite, every index within its tensor. What
`bridge.dgrd.decode` asks first of a packet's sparse sections; only when the answer is no does it read the packet
again section by section, to name the problem.

Mode 2 has two implementations of one answer: `bridge/_dgrd_native.c` (one pass in C without the GIL, with AVX2
where the CPU has it, built by `pip install`) when it is built, else numpy passes over the entries gathered 256 KiB
at a time. Mode 1 is checked here only by the C module; without it `bridge.dgrd` checks it section by section with
numpy. `tests/test_dgrd.py` runs every decode test on each (and on the C scans' scalar loops). `bridge.dgrd` walks a
packet's section headers with the same module when it is built.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

try:  # the check in one pass of C (bridge/_dgrd_native.c): 0.19 ms for GPT-2 small's 1.34M entries, numpy's 3 ms
    from dtrain.bridge import _dgrd_native as native
except ImportError:  # not built (no C compiler where it was installed): the same checks with numpy
    native = None

ENTRY_BYTES = 3  # (u8 skip, f16 value)
SCRATCH_BYTES = 1 << 18  # scratch of one pass: 256 KiB, stays in cache
# a half's exponent bits are bits 2..6 of the entry's last byte. ANDed with this mask (whole entries, one chunk), the
# entries' bytes are 0x7C somewhere iff a value is not finite: one contiguous pass instead of a 3-byte-strided one
# (1.5x faster measured)
EXPONENT_MASK = np.tile(np.array([0, 0, 0x7C], np.uint8), SCRATCH_BYTES // ENTRY_BYTES)
EXPONENT_MASK.setflags(write=False)


def mode1_valid(buf: memoryview, nnz: np.ndarray, starts: np.ndarray, elements: np.ndarray) -> bool:
    """Whether the Mode 1 sections (int64 columns as for `mode2_valid`) are within bounds and finite, in one pass of
    native code: 0.43 ms for GPT-2 small's 1.34M entries, where bridge.dgrd's numpy checks take 6 ms (strided views
    of 8-byte entries). Only with `bridge._dgrd_native` built."""
    maxima = np.empty(nnz.size, np.int64)
    return bool(native.mode1_scan(buf, starts, nnz, maxima)) and bool((maxima < elements).all())


def mode2_valid(buf: memoryview, nnz: np.ndarray, starts: np.ndarray, elements: np.ndarray,
                scratch: np.ndarray) -> bool:
    """Whether the Mode 2 sections (int64 columns: entries, offset of the first in `buf`, elements of the tensor)
    are within bounds and finite: in one pass of native code when `bridge._dgrd_native` is built, else with numpy
    (`_skip_sums_numpy`)."""
    if not nnz.size:
        return True
    if native is None:
        skip_sums = _skip_sums_numpy(buf, list(zip(nnz.tolist(), starts.tolist())), scratch)
    else:
        skip_sums = np.empty(nnz.size, np.int64)
        if not native.mode2_scan(buf, starts, nnz, skip_sums):
            skip_sums = None
    # every step is >= 1: a section's last index, its largest, is sum(skip) + nnz - 1
    return skip_sums is not None and bool((skip_sums + nnz - 1 < elements).all())


def _skip_sums_numpy(buf: memoryview, sections: list[tuple[int, int]], scratch: np.ndarray) -> Optional[np.ndarray]:
    """Each section's skips summed (int64), or None if a value is not finite.

    The entries of consecutive sections are copied back to back (without their 8-byte headers) into a 256 KiB
    gathering buffer, and each full buffer is checked with a handful of whole-array operations: the exponent-mask
    pass, and the skips summed per piece of a section by one reduceat. Per section, that leaves a slice copy in
    Python; checked one at a time, each section cost a dozen numpy calls, most of the decode time of a 148-section
    GPT-2 packet (the passes over its 4 MB took ~1.3 ms of ~6).
    """
    cap = EXPONENT_MASK.size  # a multiple of 3: a full buffer holds whole entries
    gathered = np.empty(cap, np.uint8)
    into = memoryview(gathered)
    sums: list[np.ndarray] = []  # skips summed per piece (a section's entries within one gathering)
    first_piece: list[int] = []  # per section: the index of its first piece
    starts: list[int] = []  # entry index of each piece in the gathering being filled
    fill = pieces = 0
    for nnz, pos in sections:  # (entries, offset of the first)
        first_piece.append(pieces)
        left = nnz * ENTRY_BYTES
        while left:
            take = min(left, cap - fill)
            into[fill:fill + take] = buf[pos:pos + take]
            starts.append(fill // ENTRY_BYTES)
            pieces += 1
            fill, pos, left = fill + take, pos + take, left - take
            if fill == cap:
                if not _gathering_valid(gathered[:fill], starts, sums, scratch):
                    return None
                fill, starts = 0, []
    if fill and not _gathering_valid(gathered[:fill], starts, sums, scratch):
        return None
    # in int64: a section of 2**24 entries or more may pass 2**32
    return np.add.reduceat(np.concatenate(sums), first_piece, dtype=np.int64)


def _gathering_valid(gathered: np.ndarray, starts: list[int], sums: list[np.ndarray], scratch: np.ndarray) -> bool:
    """False if a value in `gathered` (whole Mode 2 entries) is not finite; else append the skips summed per piece
    (pieces begin at entries `starts`) to `sums`."""
    masked = np.bitwise_and(gathered, EXPONENT_MASK[:gathered.size], out=scratch[:gathered.size])
    if np.maximum.reduce(masked) == 0x7C:
        return False
    # uint32: a piece is at most 87381 entries (its skips sum to under 2**25), and numpy sums u8 into uint32 1.4x as
    # fast as into int64 (this reduceat is the largest pass of a Mode 2 decode)
    sums.append(np.add.reduceat(gathered[0::3], starts, dtype=np.uint32))
    return True
