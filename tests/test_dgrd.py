"""DGRD v1 codec: round trips of every mode, byte layout, and every malformed case in NOTES.md."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dtrain.bridge import dgrd, sparse_check
from dtrain.bridge.dgrd import PacketError

pytestmark = pytest.mark.unit

ELEMENTS = [4096, 10, 1000, 3]
NATIVE = sparse_check.native  # bridge._dgrd_native, built by the install


@pytest.fixture(scope="module", autouse=True, params=["native", "native-scalar", "numpy"])
def check_path(request):
    """Every test of this module runs three times: Mode 2 checked in one pass of C (with AVX2 where the CPU has it,
    and with the scalar loop), and with numpy's passes."""
    if request.param == "native-scalar" and NATIVE is None:
        pytest.skip("bridge/_dgrd_native.c not built")
    sparse_check.native = None if request.param == "numpy" else NATIVE
    if NATIVE is not None:
        NATIVE._set_avx2(request.param == "native")
    yield request.param
    sparse_check.native = NATIVE
    if NATIVE is not None:
        NATIVE._set_avx2(True)


def dense(sections, elements):
    """The flat float32 sum a list of sections adds, via accumulate."""
    acc = [np.zeros(n, np.float32) for n in elements]
    packet = dgrd.Packet(1, 0, 0, "x", 0.0, 1, tuple(sections))
    dgrd.accumulate(packet, acc)
    return acc


def packet(sections=((1, [2, 5], [0.5, -1.0]),), flags=0, **kw):
    args = dict(step=7, node_id="node-a", train_loss=2.5, samples=4)
    args.update(kw)
    return dgrd.encode(sections=list(sections), flags=flags, **args)


# ---------------------------------------------------------------------------------------------
# layout


def test_header_bytes_match_hand_built_struct():
    data = packet(((3, [1], [2.0]),), flags=0, step=258, node_id="né")
    nid = "né".encode()
    head = struct.pack("<4sHHII", b"DGRD", 1, 0, 258, len(nid)) + nid
    head += struct.pack("<fII", 2.5, 4, 1)
    body = struct.pack("<II", 3, 1) + struct.pack("<If", 1, 2.0)
    assert data == head + body


def test_mode2_and_mode3_bytes():
    data = packet(((3, None, [1.0, -2.0, 0.5]), (1, [0, 3], [1.5, 2.0])), flags=1)
    body = data[16 + len("node-a") + 12:]
    want = struct.pack("<II", 3, 0) + struct.pack("<3e", 1.0, -2.0, 0.5)
    want += struct.pack("<II", 1, 2) + struct.pack("<Be", 0, 1.5) + struct.pack("<Be", 2, 2.0)
    assert body == want
    assert data[6:8] == b"\x01\x00"


def test_max_packet_bytes():
    assert dgrd.max_packet_bytes([10, 3]) == 16 + 256 + 12 + (8 + 80) + (8 + 24)
    biggest = dgrd.encode(0, "n" * 256, 1.0, 1, [(0, np.arange(10), np.ones(10)),
                                                   (1, np.arange(3), np.ones(3))], 0)
    assert len(biggest) == dgrd.max_packet_bytes([10, 3])


# ---------------------------------------------------------------------------------------------
# round trips

f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
# every finite float16, drawn from its bit pattern (st.floats(width=16) filters so much that Hypothesis' health
# check fails it now and then)
f16 = (st.integers(0, 0x7BFF) | st.integers(0x8000, 0xFBFF)).map(
    lambda bits: float(np.array(bits, np.uint16).view(np.float16)))


@st.composite
def model_and_sections(draw, value_strategy, unique):
    elements = draw(st.lists(st.integers(1, 700), min_size=1, max_size=4))
    tids = draw(st.lists(st.integers(0, len(elements) - 1), unique=True, min_size=1))
    sections = []
    for tid in tids:
        n = elements[tid]
        idx_st = st.integers(0, n - 1)
        idx = draw(st.lists(idx_st, min_size=1, max_size=20, unique=unique))
        vals = draw(st.lists(value_strategy, min_size=len(idx), max_size=len(idx)))
        sections.append((tid, np.array(idx, np.int64), np.array(vals, np.float32)))
    return elements, sections


@settings(deadline=None, max_examples=60)
@given(model_and_sections(f32, unique=False), st.integers(0, 2**32 - 1),
       st.text(min_size=1, max_size=20))
def test_mode1_round_trip_exact(case, step, node_id):
    elements, sections = case
    p = dgrd.decode(dgrd.encode(step, node_id, 1.25, 3, sections, 0), elements)
    assert (p.version, p.flags, p.step, p.node_id, p.train_loss, p.samples) == \
        (1, 0, step, node_id, 1.25, 3)
    assert [s.tensor_id for s in p.sections] == [t for t, _, _ in sections]
    for got, (_, idx, vals) in zip(p.sections, sections):
        assert got.indices.dtype == np.int64 and got.values.dtype == np.float32
        np.testing.assert_array_equal(got.indices, idx)  # order and repeats kept
        np.testing.assert_array_equal(got.values, vals)


@settings(deadline=None, max_examples=60)
@given(model_and_sections(f16, unique=True))
def test_mode2_round_trip_exact(case):
    elements, sections = case
    p = dgrd.decode(dgrd.encode(1, "n", 0.0, 1, sections, 1), elements)
    assert p.flags == 1
    for got, (tid, idx, vals) in zip(p.sections, sections):
        assert np.all(np.diff(got.indices) > 0)
        nz = np.isin(got.indices, idx)
        np.testing.assert_array_equal(got.values[~nz], 0)  # bridging entries are zeros
        order = np.argsort(idx)
        np.testing.assert_array_equal(got.indices[nz], idx[order])
        np.testing.assert_array_equal(got.values[nz], vals[order])


@settings(deadline=None, max_examples=40)
@given(st.lists(st.lists(f16, min_size=1, max_size=50), min_size=1, max_size=3), st.sampled_from([0, 1]))
def test_mode3_round_trip_exact_whatever_flags(tensors, flags):
    elements = [len(t) for t in tensors]
    sections = [(tid, None, np.array(t, np.float32)) for tid, t in enumerate(tensors)]
    data = dgrd.encode(0, "n", 0.0, 1, sections, flags)
    p = dgrd.decode(data, elements)
    for got, (_, _, vals) in zip(p.sections, sections):
        assert got.indices is None
        np.testing.assert_array_equal(got.values, vals)


def test_mode2_gaps_over_256_are_bridged():
    idx = np.array([0, 300, 1000])
    data = dgrd.encode(0, "n", 0.0, 1, [(0, idx, np.array([1.0, 2.0, 3.0]))], 1)
    _, nnz = struct.unpack_from("<II", data, 16 + 1 + 12)
    # 0; 256 (filler), 300; 556, 812 (fillers), 1000
    assert nnz == 6
    p = dgrd.decode(data, ELEMENTS)
    s = p.sections[0]
    np.testing.assert_array_equal(s.indices, [0, 256, 300, 556, 812, 1000])
    np.testing.assert_array_equal(s.values, [1, 0, 2, 0, 0, 3])
    np.testing.assert_array_equal(np.flatnonzero(dense(p.sections, ELEMENTS)[0]), idx)


@pytest.mark.parametrize("first,entries", [(255, 1), (256, 2), (511, 2), (512, 3)])
def test_mode2_first_index_counts_from_zero(first, entries):
    data = dgrd.encode(0, "n", 0.0, 1, [(0, [first], [1.0])], 1)
    assert struct.unpack_from("<II", data, 29)[1] == entries
    s = dgrd.decode(data, ELEMENTS).sections[0]
    assert s.indices[-1] == first and s.values[-1] == 1.0


def test_mode2_encoder_sorts_and_sums_repeats():
    data = dgrd.encode(0, "n", 0.0, 1, [(1, [7, 2, 7], [1.0, 0.5, 2.0])], 1)
    s = dgrd.decode(data, ELEMENTS).sections[0]
    np.testing.assert_array_equal(s.indices, [2, 7])
    np.testing.assert_array_equal(s.values, [0.5, 3.0])


def test_mode1_repeated_indices_add_up_in_accumulate():
    data = dgrd.encode(0, "n", 0.0, 1, [(1, [4, 2, 4, 4], [1.0, 5.0, 2.0, 0.25])], 0)
    p = dgrd.decode(data, ELEMENTS)
    acc = [np.zeros(n, np.float32) for n in ELEMENTS]
    dgrd.accumulate(p, acc, weight=2.0)
    want = np.zeros(10, np.float32)
    want[4], want[2] = 6.5, 10.0
    np.testing.assert_array_equal(acc[1], want)


def test_mixed_packet_dense_and_sparse():
    dense3 = np.array([1.0, 2.0, -0.5], np.float32)
    sections = [(3, None, dense3), (0, [4095, 0], [1.0, 2.0]), (2, [999], [-4.0])]
    for flags in (0, 1):
        p = dgrd.decode(dgrd.encode(0, "n", 0.0, 2, sections, flags), ELEMENTS)
        acc = [np.ones(n, np.float32) for n in ELEMENTS]
        dgrd.accumulate(p, acc, weight=0.5)
        np.testing.assert_array_equal(acc[3], 1 + 0.5 * dense3)
        assert acc[0][4095] == 1.5 and acc[0][0] == 2.0 and acc[0][1:4095].sum() == 4094
        assert acc[2][999] == -1.0 and np.all(acc[1] == 1)


def test_topk_sections():
    g = [np.array([[0.1, -5.0], [3.0, 0.2]]), np.array([1.0, 2.0])]
    out = dgrd.topk_sections(g, 0.5)
    assert out[0][0] == 0 and list(out[0][1]) == [1, 2] and list(out[0][2]) == [-5.0, 3.0]
    assert out[1][1] is not None and list(out[1][1]) == [1]
    assert dgrd.topk_sections([np.ones(3)], 1.0)[0][1] is None


def test_accepts_memoryview_and_bytearray():
    data = packet()
    for buf in (bytearray(data), memoryview(data), memoryview(b"zz" + data)[2:]):
        assert dgrd.decode(buf, ELEMENTS).sections[0].values.tolist() == [0.5, -1.0]


# ---------------------------------------------------------------------------------------------
# malformed packets: every case in NOTES.md "DGRD packets"


def patched(data, offset, fmt, *values):
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, *values)
    return bytes(out)


GOOD = packet()  # node_id "node-a": sections start at 16 + 6 + 12 = 34
SEC = 34


@pytest.mark.parametrize("data,message", [
    (patched(GOOD, 0, "4s", b"DGRX"), "bad magic"),
    (patched(GOOD, 4, "<H", 2), "version 2"),
    (patched(GOOD, 6, "<H", 2), "flags 2"),
    (GOOD[:10], "truncated header"),
    (GOOD[:30], "truncated header"),
    (GOOD[:-1], "truncated tensor 1 body"),
    (GOOD[:SEC + 4], "truncated"),
    (GOOD + b"\0", "trailing bytes: 1"),
    (patched(GOOD, 12, "<I", 0), "node_id_len 0"),
    (patched(GOOD, 12, "<I", 257), "node_id_len 257"),
    (patched(GOOD, 16, "2s", b"\xff\xfe"), "not valid UTF-8"),
    (patched(GOOD, SEC, "<I", 4), "tensor 4: unknown tensor id"),
    (patched(GOOD, SEC + 8, "<I", 10), "tensor 1: index 10 >= 10 elements"),
    (patched(GOOD, 22 + 4, "<I", 0), "samples == 0"),
    (patched(GOOD, 22, "<f", float("nan")), "train_loss is not finite"),
    (patched(GOOD, 22, "<f", float("inf")), "train_loss is not finite"),
    (patched(GOOD, SEC + 8 + 12, "<f", float("inf")), "tensor 1: value at entry 1 is not finite"),
    (patched(GOOD, SEC + 8 + 4, "<f", float("nan")), "tensor 1: value at entry 0 is not finite"),
    (patched(GOOD, 22 + 8, "<I", 1000), "truncated sections"),
])
def test_malformed_raises_packet_error_naming_the_problem(data, message):
    with pytest.raises(PacketError, match=message):
        dgrd.decode(data, ELEMENTS)


def test_duplicate_tensor_id():
    data = packet(((1, [1], [1.0]), (1, [2], [1.0])))
    with pytest.raises(PacketError, match="tensor 1: appears twice"):
        dgrd.decode(data, ELEMENTS)


def test_mode2_index_past_end_and_nonfinite_f16():
    data = dgrd.encode(0, "n", 0.0, 1, [(1, [3, 9], [1.0, 1.0])], 1)
    off = 29 + 8
    with pytest.raises(PacketError, match="tensor 1: index 10 >= 10 elements"):
        dgrd.decode(patched(data, off + 3, "<B", 6), ELEMENTS)  # 3 + 6 + 1 = 10
    with pytest.raises(PacketError, match="tensor 1: value at entry 1 is not finite"):
        dgrd.decode(patched(data, off + 4, "<e", float("inf")), ELEMENTS)


def test_mode3_truncated_and_nonfinite():
    data = dgrd.encode(0, "n", 0.0, 1, [(3, None, [1.0, 2.0, 3.0])], 1)
    with pytest.raises(PacketError, match="truncated tensor 3 dense body"):
        dgrd.decode(data[:-2], ELEMENTS)
    with pytest.raises(PacketError, match="tensor 3: value at entry 2 is not finite"):
        dgrd.decode(patched(data, 29 + 8 + 4, "<e", float("nan")), ELEMENTS)


def test_bad_last_section_leaves_accumulators_unchanged():
    sections = [(3, None, [1.0, 2.0, 3.0]), (0, [1, 2], [1.0, 1.0]), (1, [9], [1.0])]
    data = dgrd.encode(0, "n", 0.0, 1, sections, 0)
    bad = patched(data, len(data) - 8, "<I", 10)  # last section's only index -> 10 >= 10
    acc = [np.zeros(n, np.float32) for n in ELEMENTS]
    with pytest.raises(PacketError, match="tensor 1: index 10 >= 10 elements"):
        dgrd.accumulate(dgrd.decode(bad, ELEMENTS), acc)
    assert all(not a.any() for a in acc)
    dgrd.accumulate(dgrd.decode(data, ELEMENTS), acc)  # the good one applies
    assert acc[3].tolist() == [1.0, 2.0, 3.0] and acc[1][9] == 1.0


@settings(deadline=None, max_examples=100)
@given(st.data())
def test_truncations_and_bit_flips_only_raise_packet_error(data):
    good = dgrd.encode(3, "n", 1.0, 2, [(0, [5, 700], [1.0, 2.0]), (3, None, [1, 2, 3])],
                       data.draw(st.sampled_from([0, 1])))
    cut = data.draw(st.integers(0, len(good) - 1))
    with pytest.raises(PacketError):
        dgrd.decode(good[:cut], ELEMENTS)
    flipped = bytearray(good)
    pos = data.draw(st.integers(0, len(good) - 1))
    flipped[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        dgrd.decode(bytes(flipped), ELEMENTS)
    except PacketError:
        pass


def test_a_packets_sections_are_made_when_first_read_and_their_bytes_known_before():
    """The request path counts a packet's bytes (the pool's bound) without making its sections; whoever reads them
    first makes them, once."""
    for flags in (0, 1):
        data = dgrd.encode(3, "n", 1.0, 2, [(0, [5, 200], [1.0, 2.0]), (3, None, [1, 2, 3]), (1, [9], [0.5])], flags)
        sections = dgrd.decode(data, ELEMENTS).sections
        assert sections._items is None
        entry = 8 if flags == 0 else 3
        assert sections.nbytes == (2 + 1) * entry + 3 * 2  # what the sections hold of the packet
        assert sections._items is None
        made = tuple(sections)
        assert sum(s.nbytes for s in made) == sections.nbytes
        assert [s.tensor_id for s in sections] == [0, 3, 1] and sections[2].indices.tolist() == [9]
        assert all(a is b for a, b in zip(sections, made))  # made once: the same objects on every read


def test_encoder_refuses_what_decoder_would_reject():
    with pytest.raises(ValueError, match="node_id"):
        dgrd.encode(0, "", 0.0, 1, [], 0)
    with pytest.raises(ValueError, match="samples"):
        dgrd.encode(0, "n", 0.0, 0, [], 0)
    with pytest.raises(ValueError, match="float16"):
        dgrd.encode(0, "n", 0.0, 1, [(0, [1], [1e6])], 1)
    with pytest.raises(ValueError, match="flags"):
        dgrd.encode(0, "n", 0.0, 1, [], 2)


# ---------------------------------------------------------------------------------------------
# Mode 2 checked in one gathered pass: the same first problem as a reading section by section

BIG = [300_000, 50, 200_000, 7, 120_000]  # tensor 0's 100k entries span the 256 KiB gathering buffer


def first_problem(data: bytes, elements) -> str | None:
    """What decode must say of a packet whose header is good: its sections read one by one, each section's indices
    made in full (the reference the gathered checks are held to); None for a good packet."""
    pos = 16 + struct.unpack_from("<I", data, 12)[0] + 12
    flags, n_tensors = struct.unpack_from("<H", data, 6)[0], struct.unpack_from("<I", data, pos - 4)[0]
    assert flags == dgrd.FLAGS_MODE2
    if pos + 8 * n_tensors > len(data):
        return f"truncated sections ({n_tensors} declared)"
    seen = set()
    for k in range(n_tensors):
        if pos + 8 > len(data):
            return f"truncated section {k} header"
        tid, nnz = struct.unpack_from("<II", data, pos)
        pos += 8
        if tid >= len(elements):
            return f"tensor {tid}: unknown tensor id"
        if tid in seen:
            return f"tensor {tid}: appears twice in one packet"
        seen.add(tid)
        n = elements[tid]
        if nnz == 0:
            if pos + 2 * n > len(data):
                return f"truncated tensor {tid} dense body"
            indices, values = np.arange(n), np.frombuffer(data, "<f2", count=n, offset=pos)
            pos += 2 * n
        else:
            if pos + 3 * nnz > len(data):
                return f"truncated tensor {tid} body ({nnz} entries)"
            entries = np.frombuffer(data, [("s", "u1"), ("v", "<f2")], count=nnz, offset=pos)
            pos += 3 * nnz
            indices = np.cumsum(entries["s"].astype(np.int64) + 1) - 1
            values = entries["v"]
        if (indices >= n).any():
            return f"tensor {tid}: index {indices[np.argmax(indices >= n)]} >= {n} elements"
        if not np.isfinite(values).all():
            return f"tensor {tid}: value at entry {np.argmin(np.isfinite(values))} is not finite"
    if pos != len(data):
        return f"trailing bytes: {len(data) - pos} after the last section"
    return None


def big_mode2_packet() -> tuple[bytes, list[tuple[int, int]]]:
    """Sparse sections that each end at their tensor's last element (one more skip is out of bounds), a dense one
    between them; and (offset, bytes) of each section's body."""
    rng = np.random.default_rng(5)
    sections = []
    for tid, n in enumerate(BIG):
        if tid == 3:
            sections.append((tid, None, rng.standard_normal(n)))
            continue
        idx = np.union1d(rng.choice(n - 1, size=n // 3, replace=False), [n - 1])
        sections.append((tid, idx, rng.standard_normal(idx.size)))
    order = [2, 0, 3, 4, 1]  # not in id order
    data = dgrd.encode(1, "big", 1.0, 3, [sections[t] for t in order], dgrd.FLAGS_MODE2)
    bodies, pos = [], 16 + 3 + 12
    for _ in order:
        tid, nnz = struct.unpack_from("<II", data, pos)
        size = 3 * nnz if nnz else 2 * BIG[tid]
        bodies.append((pos + 8, size))
        pos += 8 + size
    return data, bodies


BIG_PACKET, BIG_BODIES = big_mode2_packet()


def test_big_mode2_packet_decodes_exactly():
    assert first_problem(BIG_PACKET, BIG) is None
    got = dense(dgrd.decode(BIG_PACKET, BIG).sections, BIG)
    # the same sections as the reference reads them
    assert got[0][-1] != 0 and got[2][-1] != 0 and np.count_nonzero(got[0]) == BIG[0] // 3 + 1


@settings(deadline=None, max_examples=60)
@given(st.data())
def test_mode2_checks_name_the_problem_a_section_by_section_reading_meets_first(data):
    out = bytearray(BIG_PACKET)
    for _ in range(data.draw(st.integers(1, 3))):
        section, (start, size) = data.draw(st.sampled_from(list(enumerate(BIG_BODIES))))
        what = data.draw(st.sampled_from(["skip", "value", "header", "byte"]))
        if what == "header":  # its tensor id or nnz
            out[start - 8 + data.draw(st.integers(0, 7))] ^= 1 << data.draw(st.integers(0, 7))
            continue
        at = start + data.draw(st.integers(0, size - 1))
        if what == "byte":
            out[at] = data.draw(st.integers(0, 255))
        elif section == 2:  # the dense section: a half with every exponent bit set (inf or NaN)
            out[at - (at - start) % 2 + 1] |= 0x7C
        elif what == "skip":  # one step longer: past the last element
            out[at - (at - start) % 3] += 1 if out[at - (at - start) % 3] < 255 else 0
        else:
            out[at - (at - start) % 3 + 2] |= 0x7C
    if data.draw(st.booleans()):
        out = out[:data.draw(st.integers(BIG_BODIES[0][0], len(out)))]
    expected = first_problem(bytes(out), BIG)
    if expected is None:
        dgrd.decode(bytes(out), BIG)
        return
    with pytest.raises(PacketError) as e:
        dgrd.decode(bytes(out), BIG)
    assert str(e.value).startswith(expected), (str(e.value), expected)


def test_first_bad_section_wins_over_a_later_broken_layout():
    out = bytearray(BIG_PACKET)
    start, size = BIG_BODIES[1]  # tensor 0, the second section
    out[start + size - 3] += 1  # its last step one longer: index 300000
    with pytest.raises(PacketError, match="tensor 0: index 300000 >= 300000 elements"):
        dgrd.decode(bytes(out[:-1]), BIG)  # and the last section truncated
    out[BIG_BODIES[2][0] + 1] |= 0x7C  # the dense section after it: not finite
    with pytest.raises(PacketError, match="tensor 0: index 300000"):
        dgrd.decode(bytes(out), BIG)
    out = bytearray(BIG_PACKET)
    out[BIG_BODIES[2][0] + 5] |= 0x7C  # the dense tensor 3's entry 2 ...
    out[BIG_BODIES[3][0] + 3 * 30_000 + 2] |= 0x7C  # ... before a Mode 2 section's bad value
    with pytest.raises(PacketError, match="tensor 3: value at entry 2 is not finite"):
        dgrd.decode(bytes(out), BIG)


def test_every_entry_around_a_gathering_boundary_is_checked():
    per_gathering = sparse_check.EXPONENT_MASK.size // 3  # entries
    entries_2 = BIG_BODIES[0][1] // 3  # tensor 2 is gathered first, then tensor 0
    boundary = per_gathering - entries_2  # tensor 0's first entry in the second gathering
    cases = [(0, 2, 0), (0, 2, entries_2 - 1), (1, 0, boundary - 1), (1, 0, boundary), (1, 0, 99_999)]
    for body, tid, entry in cases:
        out = bytearray(BIG_PACKET)
        out[BIG_BODIES[body][0] + 3 * entry + 2] |= 0x7C
        with pytest.raises(PacketError, match=f"tensor {tid}: value at entry {entry} is not finite"):
            dgrd.decode(bytes(out), BIG)


def test_a_section_whose_skips_sum_past_2_to_the_32_is_out_of_bounds():
    """Pieces of a section are summed in uint32, the section in int64: 16,843,010 skips of 255 sum to 2**32 + 254,
    which a 32-bit total would wrap to 254 and let a packet whose last index is past 4 billion through."""
    nnz, elements = 16_843_010, 40_000_000
    entries = np.zeros(3 * nnz, np.uint8)
    entries[0::3] = 255
    head = struct.pack("<4sHHII", b"DGRD", 1, dgrd.FLAGS_MODE2, 1, 1) + b"n" + struct.pack("<fII", 1.0, 1, 1)
    data = head + struct.pack("<II", 0, nnz) + entries.tobytes()
    # the indices are 255, 511, ... 256 j + 255: the first past the end is 256 * 156250 + 255
    with pytest.raises(PacketError, match="tensor 0: index 40000255 >= 40000000 elements"):
        dgrd.decode(data, [elements])


def test_steps_of_200_reach_the_last_element_and_one_more_is_refused():
    """Skips of 199 (the high bit set): the check sums all eight bits of every skip."""
    elements = [40_000]
    last = dgrd.encode(1, "n", 1.0, 1, [(0, np.arange(199, 40_000, 200), np.ones(200))], dgrd.FLAGS_MODE2)
    assert dense(dgrd.decode(last, elements).sections, elements)[0][39_999] == 1
    past = bytearray(last)
    past[16 + 1 + 12 + 8] += 1  # the first skip one longer: every index after it moves by one
    with pytest.raises(PacketError, match="tensor 0: index 40000 >= 40000 elements"):
        dgrd.decode(bytes(past), elements)
