"""Codec for DGRD v1 gradient packets (training-server-api-v1.md, "Binary Gradient Packet").

Pure functions on bytes and numpy arrays: no web import, so the HTTP layer, the tests and
``bench/bench_ingest.py`` all drive the same code.

Layout, all little-endian::

    header   0  4s  magic "DGRD"
             4  u16 version (1)
             6  u16 flags   (0: sparse sections are Mode 1, 1: sparse sections are Mode 2)
             8  u32 step
            12  u32 node_id_len (1..256)
            16  ... node_id (UTF-8, node_id_len bytes)
             +0 f32 train_loss
             +4 u32 samples (> 0)
             +8 u32 n_tensors
    section  +0 u32 tensor_id
             +4 u32 nnz
             +8 body, one of
                 nnz == 0            Mode 3: tensor_elements x f16 value (dense)
                 nnz > 0, flags == 0 Mode 1: nnz x (u32 index, f32 value)
                 nnz > 0, flags == 1 Mode 2: nnz x (u8 skip, f16 value)

Mode 2 indices: the first is ``skip[0]``, each next is ``previous + skip + 1``, i.e.
``cumsum(skip + 1) - 1``. A step longer than 256 is bridged by the encoder with zero-valued entries.

``decode`` validates the whole packet before it returns, so a caller that decodes and then
``accumulate``s applies a packet entirely or not at all. It validates with reductions over the packet's own
bytes and allocates nothing per entry: sparse sections come back as ``LazySection``s that widen their indices
to int64 and their values to float32 when first read (on the node's training thread), once. It reads the section
headers first, then checks every sparse section's entries at once (``bridge.sparse_check``); only a bad packet
is read again section by section, so that it fails with the problem a reading in packet order meets first.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence, Union

import numpy as np

from dtrain.bridge import sparse_check
from dtrain.node.contribution import AnySection, LazySection, LazySections, Section, add_sections

MAGIC = b"DGRD"
VERSION = 1
FLAGS_MODE1 = 0  # sparse sections carry (u32 index, f32 value)
FLAGS_MODE2 = 1  # sparse sections carry (u8 skip, f16 value)
MAX_NODE_ID_BYTES = 256
MAX_SKIP = 255  # largest u8 skip: one Mode 2 entry advances the index by at most 256

HEAD = struct.Struct("<4sHHII")  # magic, version, flags, step, node_id_len
TAIL = struct.Struct("<fII")  # train_loss, samples, n_tensors
SECTION = struct.Struct("<II")  # tensor_id, nnz

MODE1_ENTRY = np.dtype([("i", "<u4"), ("v", "<f4")])  # itemsize 8
MODE2_ENTRY = np.dtype([("s", "<u1"), ("v", "<f2")])  # packed, itemsize 3
DENSE_ENTRY = np.dtype("<f2")
MODE1_ENTRY_BYTES, MODE2_ENTRY_BYTES, DENSE_ENTRY_BYTES = MODE1_ENTRY.itemsize, MODE2_ENTRY.itemsize, DENSE_ENTRY.itemsize
CHECK_CHUNK_BYTES = sparse_check.SCRATCH_BYTES  # scratch of one validation pass: 256 KiB, stays in cache

# float32 value of every float16 bit pattern (inf and NaN included, so a check after the lookup
# still sees them): numpy casts float16 in software, a 256 KiB table lookup is ~7x faster
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
F16_TO_F32.setflags(write=False)

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]  # np.ndarray: a body from bridge.bodybuf


class PacketError(ValueError):
    """A packet that does not follow DGRD v1; the message names the problem."""


@dataclass(frozen=True)
class Packet:
    version: int
    flags: int
    step: int
    node_id: str
    train_loss: float
    samples: int
    # the node's sections (node.contribution), made on first read: a dense one is a Section holding the packet's
    # float16 (a view); a sparse one is a LazySection over the packet's entries (int64 indices and float32 values
    # on first read)
    sections: Sequence[AnySection]


# ---------------------------------------------------------------------------------------------
# decode


def _need(buf: memoryview, pos: int, size: int, what: str) -> None:
    if pos + size > len(buf):
        raise PacketError(f"truncated {what}: need {size} bytes at offset {pos}, "
                          f"packet has {len(buf) - pos}")


def _check_bounds(tid: int, indices: np.ndarray, elements: int) -> None:
    if indices.size and int(indices.max()) >= elements:
        bad = int(indices[int(np.argmax(indices >= elements))])
        raise PacketError(f"tensor {tid}: index {bad} >= {elements} elements")


def _not_finite(tid: int, values: np.ndarray) -> None:
    """Name the first entry that is not finite (only a packet that failed a check pays for this pass)."""
    finite = np.isfinite(values)
    if not finite.all():
        bad = int(np.argmin(finite))
        raise PacketError(f"tensor {tid}: value at entry {bad} is not finite ({values[bad]})")


def _check_finite_f32(tid: int, values: np.ndarray, scratch: np.ndarray) -> None:
    """max |v| is finite iff every v is (NaN propagates through both), a chunk at a time: no copy of the section."""
    out = scratch.view(np.float32)
    for start in range(0, values.size, out.size):
        chunk = values[start:start + out.size]
        if not np.isfinite(np.abs(chunk, out=out[:chunk.size]).max()):
            _not_finite(tid, values)


def _check_finite_f16(tid: int, values: np.ndarray, scratch: np.ndarray) -> None:
    """Dense float16 checked on its bits, a chunk at a time: no float32 copy of the tensor is made.

    A half is finite iff its exponent bits are not all ones: with the sign shifted out,
    ``bits << 1 < 0xF800``. numpy's float16 arithmetic is software; this stays in uint16 SIMD.
    """
    bits, out = values.view("<u2"), scratch.view(np.uint16)
    for start in range(0, bits.size, out.size):
        chunk = bits[start:start + out.size]
        if np.left_shift(chunk, 1, out=out[:chunk.size]).max() >= 0xF800:
            _not_finite(tid, values)


def _check_mode1(tid: int, rec: np.ndarray, elements: int, scratch: np.ndarray) -> None:
    if int(rec["i"].max()) >= elements:  # a strided view of the packet's u32: nothing widened
        _check_bounds(tid, rec["i"], elements)
    _check_finite_f32(tid, rec["v"], scratch)


def _check_mode2(tid: int, raw: np.ndarray, elements: int, scratch: np.ndarray) -> None:
    """Two reductions over the section's bytes (``raw``: nnz x (u8 skip, f16 value)); no index array is built.

    Every step is >= 1, so the indices strictly increase and the last is the largest: ``cumsum(skip + 1) - 1``
    ends at ``sum(skip) + nnz - 1``. A half is not finite iff its five exponent bits are all ones.
    """
    nnz = raw.size // MODE2_ENTRY_BYTES
    if int(np.add.reduce(raw[0::3], dtype=np.int64)) + nnz - 1 >= elements:
        _check_bounds(tid, _mode2_indices(raw), elements)
    step = sparse_check.EXPONENT_MASK.size
    for start in range(0, raw.size, step):
        chunk = raw[start:start + step]
        if np.maximum.reduce(np.bitwise_and(chunk, sparse_check.EXPONENT_MASK[:chunk.size], out=scratch[:chunk.size])) == 0x7C:
            _not_finite(tid, _half_to_f32(raw.view(MODE2_ENTRY)["v"]))


def _half_to_f32(half: np.ndarray) -> np.ndarray:
    """float16 (any stride) -> float32 by table: numpy's own cast is ~7 ns per element, this ~1."""
    return F16_TO_F32.take(half.view("<u2"), mode="clip")  # every uint16 is in range: no bounds pass


# what a LazySection makes on first read, from a validated section's bytes


def _mode1_arrays(rec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return rec["i"].astype(np.int64), rec["v"]  # values: a strided view of the packet's float32, no copy


def _mode2_indices(raw: np.ndarray) -> np.ndarray:
    steps = np.add(raw[0::3], 1, dtype=np.int64)  # skip + 1; the first counts from a virtual -1
    steps[0] -= 1
    return np.cumsum(steps, out=steps)


def _mode2_arrays(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _mode2_indices(raw), _half_to_f32(raw.view(MODE2_ENTRY)["v"])


def _mode2_arrays_at(buf: memoryview, start: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    return _mode2_arrays(np.frombuffer(buf, np.uint8, count=size, offset=start))


@dataclass(frozen=True)
class Layout:
    """Where each section's body lies, in packet order: int64 columns of one row per section."""

    tids: np.ndarray
    nnzs: np.ndarray  # 0: dense (Mode 3)
    starts: np.ndarray  # offset of the section's first entry in the packet
    elements: np.ndarray  # of the tensor

    @classmethod
    def of_rows(cls, rows: list[tuple[int, int, int, int]]) -> "Layout":
        columns = np.array(rows, np.int64).reshape(-1, 4)
        return cls(*(np.ascontiguousarray(c) for c in columns.T))

    def rows(self) -> list[tuple[int, int, int, int]]:
        return list(zip(self.tids.tolist(), self.nnzs.tolist(), self.starts.tolist(), self.elements.tolist()))


def _layout(buf: memoryview, pos: int, n_tensors: int, flags: int, tensor_elements: Sequence[int]
            ) -> tuple[Layout, Optional[PacketError]]:
    """Walk the section headers. Returns the sections up to the first problem of the layout, and that problem
    (not raised: the values of the sections before it are checked first, as a reading section by section would).
    A good packet's headers are walked in C (`_dgrd_native.layout`) when it is built; this reads them again, in
    Python, only to name a problem."""
    if sparse_check.native is not None:
        elements = np.asarray(tensor_elements, np.int64)
        tids, nnzs, starts = (np.empty(n_tensors, np.int64) for _ in range(3))
        if sparse_check.native.layout(buf, pos, n_tensors, flags, elements, tids, nnzs, starts):
            return Layout(tids, nnzs, starts, elements[tids]), None
    rows: list[tuple[int, int, int, int]] = []
    seen: set[int] = set()
    entry_bytes = MODE1_ENTRY_BYTES if flags == FLAGS_MODE1 else MODE2_ENTRY_BYTES
    length, known, header = len(buf), len(tensor_elements), SECTION.size
    broken = None
    try:
        for k in range(n_tensors):
            if pos + header > length:
                _need(buf, pos, header, f"section {k} header")
            tid, nnz = SECTION.unpack_from(buf, pos)
            pos += header
            if tid >= known:
                raise PacketError(f"tensor {tid}: unknown tensor id (model has {known} tensors)")
            if tid in seen:
                raise PacketError(f"tensor {tid}: appears twice in one packet")
            seen.add(tid)
            elements = int(tensor_elements[tid])
            size = nnz * entry_bytes if nnz else elements * DENSE_ENTRY_BYTES  # nnz == 0: Mode 3 whatever flags says
            if pos + size > length:
                _need(buf, pos, size, f"tensor {tid} body ({nnz} entries)" if nnz else f"tensor {tid} dense body")
            rows.append((tid, nnz, pos, elements))
            pos += size
        if pos != length:
            raise PacketError(f"trailing bytes: {length - pos} after the last section")
    except PacketError as e:
        broken = e
    return Layout.of_rows(rows), broken


def _check_section(buf: memoryview, flags: int, tid: int, nnz: int, start: int, elements: int,
                   scratch: np.ndarray) -> None:
    """Check one section's values; raises the PacketError naming its first problem."""
    if nnz == 0:
        _check_finite_f16(tid, np.frombuffer(buf, DENSE_ENTRY, count=elements, offset=start), scratch)
    elif flags == FLAGS_MODE1:
        _check_mode1(tid, np.frombuffer(buf, MODE1_ENTRY, count=nnz, offset=start), elements, scratch)
    else:
        _check_mode2(tid, np.frombuffer(buf, np.uint8, count=nnz * MODE2_ENTRY_BYTES, offset=start), elements,
                     scratch)


def _raise_first_invalid(buf: memoryview, layout: Layout, flags: int, scratch: np.ndarray) -> None:
    """Section by section, in packet order: raise the first section's problem (only a bad packet pays for this)."""
    for section in layout.rows():
        _check_section(buf, flags, *section, scratch)
    raise AssertionError("_values_valid found a problem that no section's own check finds")


def _values_valid(buf: memoryview, layout: Layout, flags: int, scratch: np.ndarray) -> bool:
    """Whether every section's values are within bounds and finite: the sparse ones in one pass (Mode 2 always,
    Mode 1 when the C module is built), the others one by one."""
    at_once = flags == FLAGS_MODE2 or sparse_check.native is not None
    sparse = layout.nnzs > 0 if at_once else np.zeros(layout.nnzs.size, bool)
    others = np.flatnonzero(~sparse)
    for tid, nnz, start, elements in zip(*(column[others].tolist() for column in
                                           (layout.tids, layout.nnzs, layout.starts, layout.elements))):
        try:
            _check_section(buf, flags, tid, nnz, start, elements, scratch)
        except PacketError:
            return False
    if others.size == sparse.size:
        return True
    columns = layout.nnzs[sparse], layout.starts[sparse], layout.elements[sparse]
    if flags == FLAGS_MODE2:
        return sparse_check.mode2_valid(buf, *columns, scratch)
    return sparse_check.mode1_valid(buf, *columns)


def _sections(buf: memoryview, layout: Layout, flags: int) -> tuple[AnySection, ...]:
    """A checked packet's sections, as views of its bytes: made on first read (see LazySections)."""
    sections: list[AnySection] = []
    for tid, nnz, start, elements in layout.rows():
        if nnz == 0:
            # kept as float16, a view of the packet: add_sections converts it a chunk at a time
            # as it adds, so no float32 copy (twice the packet) is ever made of a dense tensor
            sections.append(Section(tid, None, np.frombuffer(buf, DENSE_ENTRY, count=elements, offset=start)))
        elif flags == FLAGS_MODE1:
            rec = np.frombuffer(buf, MODE1_ENTRY, count=nnz, offset=start)
            sections.append(LazySection(tid, False, rec.nbytes, partial(_mode1_arrays, rec)))
        else:
            size = nnz * MODE2_ENTRY_BYTES
            sections.append(LazySection(tid, True, size, partial(_mode2_arrays_at, buf, start, size)))
    return tuple(sections)


def decode(data: Buffer, tensor_elements: Sequence[int]) -> Packet:
    """Parse and fully validate one packet; ``tensor_elements[i]`` is tensor i's element count.

    Sections hold views into ``data`` (a dense one its float16, a sparse one its entries), so keep ``data``
    unchanged while the packet lives.
    """
    buf = memoryview(data).cast("B")
    _need(buf, 0, HEAD.size, "header")
    magic, version, flags, step, id_len = HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise PacketError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise PacketError(f"unsupported version {version}, expected {VERSION}")
    if flags not in (FLAGS_MODE1, FLAGS_MODE2):
        raise PacketError(f"flags {flags} not in (0, 1)")
    if not 1 <= id_len <= MAX_NODE_ID_BYTES:
        raise PacketError(f"node_id_len {id_len} not in 1..{MAX_NODE_ID_BYTES}")
    pos = HEAD.size
    _need(buf, pos, id_len, "node_id")
    try:
        node_id = bytes(buf[pos:pos + id_len]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise PacketError(f"node_id is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    pos += id_len
    _need(buf, pos, TAIL.size, "header")
    train_loss, samples, n_tensors = TAIL.unpack_from(buf, pos)
    pos += TAIL.size
    if not np.isfinite(train_loss):
        raise PacketError(f"train_loss is not finite ({train_loss})")
    if samples == 0:
        raise PacketError("samples == 0")
    # Every section is at least 8 bytes: refuse an absurd count before looping over it.
    _need(buf, pos, n_tensors * SECTION.size, f"sections ({n_tensors} declared)")

    layout, broken = _layout(buf, pos, n_tensors, flags, tensor_elements)
    scratch = np.empty(CHECK_CHUNK_BYTES, np.uint8)
    # The checks of the values run after the layout is known, all Mode 2 sections in one gathered pass; a packet
    # fails with the problem a reading section by section meets first: the first section whose values are wrong,
    # or else the layout's problem (which lies after every section in `layout`).
    if not _values_valid(buf, layout, flags, scratch):
        _raise_first_invalid(buf, layout, flags, scratch)
    if broken is not None:
        raise broken
    entry_bytes = MODE1_ENTRY_BYTES if flags == FLAGS_MODE1 else MODE2_ENTRY_BYTES
    nbytes = int(np.where(layout.nnzs == 0, layout.elements * DENSE_ENTRY_BYTES, layout.nnzs * entry_bytes).sum())
    return Packet(version, flags, step, node_id, float(train_loss), samples,
                  LazySections(nbytes, partial(_sections, buf, layout, flags)))


# ---------------------------------------------------------------------------------------------
# encode


def _bridge(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique indices -> Mode 2 (skips u8, values f16), zero entries bridging long steps."""
    steps = np.diff(indices, prepend=-1)  # >= 1; the first step counts from a virtual -1
    per = (steps - 1) // (MAX_SKIP + 1) + 1  # entries each index needs, fillers included
    ends = np.cumsum(per) - 1  # position of each real entry
    total = int(ends[-1]) + 1
    skips = np.full(total, MAX_SKIP, np.uint8)  # a filler advances by exactly 256
    skips[ends] = steps - (MAX_SKIP + 1) * (per - 1) - 1
    out = np.zeros(total, np.float16)
    out[ends] = values
    return skips, out


def _to_f16(tid: int, values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        half = np.asarray(values, np.float32).astype("<f2")
    if not np.isfinite(half).all():
        raise ValueError(f"tensor {tid}: value not finite or beyond float16 range")
    return half


def encode(step: int, node_id: str, train_loss: float, samples: int,
           sections: Sequence[tuple[int, np.ndarray | None, np.ndarray] | AnySection],
           flags: int = FLAGS_MODE1) -> bytes:
    """Build a packet. ``sections`` holds (tensor_id, indices or None for dense, values).

    Dense sections go out as Mode 3 (f16). Sparse ones as Mode 1 when ``flags == 0`` (kept as
    given, repeats included) or Mode 2 when ``flags == 1`` (sorted, repeats summed, bridged).
    A sparse section with no entries is left out: nnz == 0 would mean dense, and it adds nothing.
    """
    if flags not in (FLAGS_MODE1, FLAGS_MODE2):
        raise ValueError(f"flags {flags} not in (0, 1)")
    nid = node_id.encode("utf-8")
    if not 1 <= len(nid) <= MAX_NODE_ID_BYTES:
        raise ValueError(f"node_id is {len(nid)} bytes in UTF-8, must be 1..{MAX_NODE_ID_BYTES}")
    if not 1 <= samples < 2**32:
        raise ValueError(f"samples {samples} not in 1..2**32-1")
    with np.errstate(over="ignore"):
        loss32 = np.float32(train_loss)
    if not np.isfinite(loss32):
        raise ValueError(f"train_loss {train_loss} is not finite as float32")

    body: list[bytes] = []
    for s in sections:
        tid, indices, values = ((s.tensor_id, s.indices, s.values) if isinstance(s, (Section, LazySection))
                                else s)
        values = np.asarray(values).reshape(-1)
        if indices is None:
            body += [SECTION.pack(tid, 0), _to_f16(tid, values).tobytes()]
            continue
        indices = np.asarray(indices).reshape(-1).astype(np.int64)
        if indices.shape != values.shape:
            raise ValueError(f"tensor {tid}: {indices.size} indices but {values.size} values")
        if indices.size == 0:
            continue
        if indices.min() < 0 or indices.max() >= 2**32:
            raise ValueError(f"tensor {tid}: index out of u32 range")
        if flags == FLAGS_MODE1:
            if not np.isfinite(values).all():
                raise ValueError(f"tensor {tid}: value not finite")
            rec = np.empty(indices.size, MODE1_ENTRY)
            rec["i"] = indices
            rec["v"] = values
        else:
            if indices.size > 1 and not (np.diff(indices) > 0).all():
                indices, inverse = np.unique(indices, return_inverse=True)
                values = np.bincount(inverse, weights=values, minlength=indices.size)
            skips, half = _bridge(indices, _to_f16(tid, values))
            rec = np.empty(skips.size, MODE2_ENTRY)
            rec["s"] = skips
            rec["v"] = half
        body += [SECTION.pack(tid, rec.size), rec.tobytes()]

    head = HEAD.pack(MAGIC, VERSION, flags, step, len(nid)) + nid
    tail = TAIL.pack(train_loss, samples, len(body) // 2)
    return b"".join([head, tail, *body])


def topk_sections(grads: Sequence[np.ndarray], fraction: float
                  ) -> list[tuple[int, np.ndarray | None, np.ndarray]]:
    """Keep the ``fraction`` largest-magnitude entries of each gradient (at least one).

    A tensor that would keep every element is sent dense.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction {fraction} not in (0, 1]")
    out = []
    for tid, g in enumerate(grads):
        flat = np.asarray(g, np.float32).reshape(-1)
        k = max(1, int(round(flat.size * fraction)))
        if k >= flat.size:
            out.append((tid, None, flat))
            continue
        idx = np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]
        idx.sort()
        out.append((tid, idx.astype(np.int64), flat[idx]))
    return out


# ---------------------------------------------------------------------------------------------
# apply


def accumulate(packet: Packet, accumulators: Sequence[np.ndarray], weight: float = 1.0) -> None:
    """Add ``weight * values`` of every section into the flat float32 ``accumulators[tid]``.

    Call only with a packet ``decode`` returned: it has checked ids and bounds already.
    """
    add_sections(accumulators, packet.sections, weight)


def max_packet_bytes(tensor_elements: Sequence[int]) -> int:
    """Largest packet the model allows: 256-byte node_id, every tensor dense in Mode 1."""
    head = HEAD.size + MAX_NODE_ID_BYTES + TAIL.size
    return head + sum(SECTION.size + MODE1_ENTRY_BYTES * int(n) for n in tensor_elements)
