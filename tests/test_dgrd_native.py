"""bridge/_dgrd_native.c, the C half of a DGRD decode: built, its arguments bounded, and every answer held to the
Python and numpy it stands in for (`tests/test_dgrd.py` runs the whole decode through it, and without it)."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dtrain.bridge import dgrd, sparse_check

pytestmark = pytest.mark.unit

ELEMENTS = [4096, 10, 1000, 3]
NATIVE = sparse_check.native  # bridge._dgrd_native, built by the install


@pytest.fixture(scope="module", params=["avx2", "scalar"])
def scan_path(request):
    """The scan with AVX2 (where the CPU has it) and with the scalar loop."""
    NATIVE._set_avx2(request.param == "avx2")
    yield request.param
    NATIVE._set_avx2(True)


def test_the_native_check_is_built():
    """`pip install -e .` builds it where there is a C compiler, as on every machine this project runs on; without
    it every Mode 2 packet would be checked 3x slower, silently."""
    assert NATIVE is not None, "bridge/_dgrd_native.c was not built: run the install again (make setup)"


@pytest.mark.skipif(NATIVE is None, reason="not built")
def test_the_native_check_refuses_sections_outside_the_body():
    body, sums = bytes(30), np.zeros(1, np.int64)
    for start, count in ((28, 1), (-1, 1), (0, 11), (31, 0), (0, -1)):
        with pytest.raises(ValueError, match="outside the 30-byte body"):
            NATIVE.mode2_scan(body, np.array([start], np.int64), np.array([count], np.int64), sums)
    with pytest.raises(ValueError, match="one length"):
        NATIVE.mode2_scan(body, np.zeros(2, np.int64), np.zeros(1, np.int64), sums)
    assert NATIVE.mode2_scan(body, np.array([0], np.int64), np.array([10], np.int64), sums) and sums[0] == 0
    for start, count in ((23, 1), (-1, 1), (0, 4), (31, 0)):  # Mode 1 entries are 8 bytes
        with pytest.raises(ValueError, match="outside the 30-byte body"):
            NATIVE.mode1_scan(body, np.array([start], np.int64), np.array([count], np.int64), sums)
    assert NATIVE.mode1_scan(body, np.array([22], np.int64), np.array([1], np.int64), sums) and sums[0] == 0
    columns = [np.zeros(2, np.int64) for _ in range(3)]
    for pos, n_tensors in ((-1, 2), (0, 31), (0, 3)):  # before the body; more sections than bytes; arrays too short
        with pytest.raises(ValueError, match="out of range|wrong size"):
            NATIVE.layout(body, pos, n_tensors, 1, np.array([4], np.int64), *columns)


@pytest.mark.skipif(NATIVE is None, reason="not built")
@settings(deadline=None, max_examples=200)
@given(st.data())
def test_the_native_scan_sums_and_checks_like_numpy(scan_path, data):
    """mode2_scan's skip sums and finite check against plain numpy, over sections long and short enough to end
    anywhere in the 32-entry steps of the AVX2 loop, at any offset, with a value that is not finite anywhere."""
    counts = data.draw(st.lists(st.integers(0, 200), min_size=1, max_size=4))
    offset = data.draw(st.integers(0, 40))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    body = rng.integers(0, 256, offset + 3 * sum(counts) + data.draw(st.integers(0, 5)), dtype=np.uint8)
    entries = body[offset:offset + 3 * sum(counts)].reshape(-1, 3)
    entries[:, 2] &= 0x7B  # every value finite (an exponent bit cleared) ...
    if entries.size and data.draw(st.booleans()):  # ... but maybe one
        entries[data.draw(st.integers(0, len(entries) - 1)), 2] |= 0x7C
    starts = offset + 3 * np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    sums = np.full(len(counts), -1, np.int64)
    ok = NATIVE.mode2_scan(body.tobytes(), starts, np.array(counts, np.int64), sums)
    assert ok == bool(((entries[:, 2] & 0x7C) != 0x7C).all())
    if ok:
        skips = np.split(entries[:, 0].astype(np.int64), np.cumsum(counts)[:-1])
        assert sums.tolist() == [int(k.sum()) for k in skips]


@pytest.mark.skipif(NATIVE is None, reason="not built")
@settings(deadline=None, max_examples=200)
@given(st.data())
def test_the_native_mode1_scan_finds_the_largest_index_and_checks_like_numpy(scan_path, data):
    """mode1_scan's largest index per section and finite check against plain numpy, over sections of any length at
    any offset, indices anywhere in u32 (unsorted, repeated), with a value that is not finite anywhere."""
    counts = data.draw(st.lists(st.integers(0, 100), min_size=1, max_size=4))
    offset = data.draw(st.integers(0, 40))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    body = rng.integers(0, 256, offset + 8 * sum(counts) + data.draw(st.integers(0, 9)), dtype=np.uint8)
    entries = body[offset:offset + 8 * sum(counts)].view(dgrd.MODE1_ENTRY)
    bits = entries["v"].view("<u4")
    bits &= ~np.uint32(1 << 30)  # every value finite (an exponent bit cleared) ...
    if entries.size and data.draw(st.booleans()):  # ... but maybe one: infinity or a NaN
        bits[data.draw(st.integers(0, len(entries) - 1))] |= np.uint32(0x7F800000)
    starts = offset + 8 * np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    maxima = np.full(len(counts), -1, np.int64)
    ok = NATIVE.mode1_scan(body.tobytes(), starts, np.array(counts, np.int64), maxima)
    assert ok == bool(np.isfinite(entries["v"]).all())
    if ok:
        indices = np.split(entries["i"].astype(np.int64), np.cumsum(counts)[:-1])
        assert maxima.tolist() == [int(i.max()) if i.size else 0 for i in indices]


@pytest.mark.skipif(NATIVE is None, reason="not built")
@settings(deadline=None, max_examples=300)
@given(st.data())
def test_the_native_layout_walk_reads_the_headers_as_the_python_one(data):
    """`_dgrd_native.layout` says yes exactly when the Python walk finds no problem, with the same columns: over
    packets whose section headers (ids, nnz) are rewritten, cut, or followed by extra bytes."""
    flags = data.draw(st.sampled_from([0, 1]))
    sections = [(0, [5, 700], [1.0, 2.0]), (3, None, [1, 2, 3]), (1, [9], [0.5])]
    packet = bytearray(dgrd.encode(3, "n", 1.0, 2, sections, flags))
    pos = dgrd.HEAD.size + 1 + dgrd.TAIL.size
    headers, p = [], pos
    for tid, nnz_raw, _ in sections:  # where each section header lies
        headers.append(p)
        nnz = len(nnz_raw) if nnz_raw is not None else 0
        p += 8 + (nnz * (8 if flags == 0 else 3) if nnz else ELEMENTS[tid] * 2)
    for _ in range(data.draw(st.sampled_from([0, 1, 1, 1, 2]))):
        at = data.draw(st.sampled_from(headers)) + data.draw(st.sampled_from([0, 4]))
        struct.pack_into("<I", packet, at, data.draw(st.sampled_from([0, 1, 2, 3, 4, 9, 2**32 - 1])))
    if data.draw(st.sampled_from([False, False, False, True])):
        packet = packet[:data.draw(st.integers(pos, len(packet)))]
    packet += bytes(data.draw(st.sampled_from([0, 0, 0, 1, 3])))
    buf = memoryview(bytes(packet))
    n_tensors = data.draw(st.sampled_from([3, 3, 3, 2, 4]))
    sparse_check.native = None
    try:
        want, broken = dgrd._layout(buf, pos, n_tensors, flags, ELEMENTS)
    finally:
        sparse_check.native = NATIVE
    columns = [np.full(n_tensors, -1, np.int64) for _ in range(3)]
    ok = NATIVE.layout(buf, pos, n_tensors, flags, np.array(ELEMENTS, np.int64), *columns)
    assert ok == (broken is None)
    if ok:
        assert [c.tolist() for c in columns] == [want.tids.tolist(), want.nnzs.tolist(), want.starts.tolist()]
