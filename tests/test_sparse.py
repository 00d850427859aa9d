"""The sparse wire codec (node.lowcomm.sparse) and the error feedback of a node's rounds (node.lowcomm.rounds):
top-k per tensor, payloads decoded to the same bits, every malformed payload refused, the average the same bits for
the same payloads, and the error feedback dropping nothing and sending nothing twice."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dtrain.node.lowcomm import codec, sparse
from dtrain.node.lowcomm.rounds import InnerRounds
from dtrain.node.swarm.deadlines import allreduce_bytes

pytestmark = pytest.mark.unit


def test_top_k_keeps_the_largest_fraction_of_every_tensor():
    a = torch.tensor([0.1, -5.0, 0.3, 2.0, -0.2, 0.0, 1.0, 0.05, 0.0, 0.0])
    b = torch.tensor([[1e-6, -1e-7]])  # small tensors still send one element
    ka, kb = sparse.top_k([a, b], 0.3)
    assert torch.equal(ka, torch.tensor([0.0, -5.0, 0.0, 2.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(kb, torch.tensor([[1e-6, 0.0]]))
    assert sparse.kept(10, 0.3) == 3 and sparse.kept(2, 0.3) == 1 and sparse.kept(0, 0.3) == 0
    assert sparse.max_kept([10, 2], 0.3) == 4


def test_a_payload_decodes_to_the_same_bits():
    flat = torch.zeros(1000)
    idx = torch.tensor([3, 17, 500, 999])
    flat[idx] = torch.tensor([1.5, -2.25e-8, 3.0e30, -7.0])
    data = sparse.encode(flat)
    assert len(data) == sparse.HEADER.size + 4 * 4 + 4 * 4  # four u32 indices (16 bytes < a 125-byte bitmask)
    got_idx, got_values = sparse.decode(data, total=1000, limit=4)
    assert torch.equal(got_idx, idx) and torch.equal(got_values, flat[idx])
    assert sparse.decode(sparse.encode(torch.zeros(5)), total=5, limit=0)[0].numel() == 0


def test_a_dense_enough_payload_sends_a_bitmask_and_8_bit_values():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10_001, generator=g) * 1e-3
    flat = sparse.quantize(sparse.top_k([x], 0.1))[0]
    count = int((flat != 0).sum())
    assert count == sparse.kept(10_001, 0.1)  # a kept value never quantizes to 0
    data = sparse.encode(flat, quantized=True)
    # 1,251 bytes of bitmask instead of 4,004 of indices; a byte per value and one exponent per 64 values
    assert len(data) == sparse.HEADER.size + 1251 + count + -(-count // 64)
    assert data[8] == sparse.BITMASK and data[9] == sparse.I8
    idx, values = sparse.decode(data, total=10_001, limit=count, quantized=True)
    assert torch.equal(idx, torch.nonzero(flat, as_tuple=True)[0]) and torch.equal(values, flat[idx])
    with pytest.raises(sparse.BadPayload, match="value type"):
        sparse.decode(data, total=10_001, limit=count)  # fp32 values were expected
    assert len(data) == sparse.payload_bytes(count, 10_001, quantized=True)


def test_a_model_as_its_tensors_encodes_to_the_bytes_of_its_flat_concatenation():
    # what a round offers and logs is encoded tensor by tensor, with no flat copy of the model: the same payload
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(s, generator=g) for s in [(30, 40), (7,), (0,), (1001,)]]
    for fraction, layout in [(0.3, sparse.BITMASK), (0.01, sparse.INDICES)]:
        kept = sparse.quantize(sparse.top_k(tensors, fraction))
        flat = torch.cat([t.reshape(-1) for t in kept])
        for quantized in (False, True):
            data = sparse.encode(kept, quantized=quantized)
            assert data == sparse.encode(flat, quantized=quantized) and data[8] == layout
            idx, values = sparse.decode(data, flat.numel(), flat.numel(), quantized=quantized)
            assert torch.equal(idx, torch.nonzero(flat, as_tuple=True)[0]) and torch.equal(values, flat[idx])


def test_quantizing_in_chunks_gives_the_bits_of_one_pass(monkeypatch):
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 6, s, generator=g) for s in [(500,), (333,)]]
    kept = sparse.top_k(tensors, 0.7)
    whole = sparse.quantize(kept)
    data = sparse.encode(whole, quantized=True)
    monkeypatch.setattr(sparse, "CHUNK", 2 * sparse.BLOCK)  # 583 kept values: 5 chunks, the last one short
    assert all(torch.equal(a, b) for a, b in zip(whole, sparse.quantize(kept)))
    assert sparse.encode(whole, quantized=True) == data
    idx, values = sparse.decode(data, 833, 833, quantized=True)
    assert torch.equal(values, torch.cat(whole)[idx])


def test_quantize_keeps_8_bits_per_block_exactly_and_is_its_own_fixed_point():
    g = torch.Generator().manual_seed(2)
    x = sparse.top_k([torch.randn(3000, generator=g) * torch.logspace(-6, 2, 3000)], 0.2)[0]
    q = sparse.quantize([x])[0]
    kept_x, kept_q = x[x != 0].double().numpy(), q[x != 0].double().numpy()
    assert np.all(kept_q != 0) and torch.equal(q == 0, x == 0)
    for block in range(0, kept_x.size, sparse.BLOCK):  # within half a step of a 127-step scale of the block's peak
        xs, qs = kept_x[block:block + sparse.BLOCK], kept_q[block:block + sparse.BLOCK]
        step = np.abs(xs).max() / 127
        assert np.all(np.abs(qs - xs) <= np.maximum(step, np.abs(xs)))  # |q| >= 1 step for the smallest
        assert np.all(np.abs(qs - xs)[np.abs(xs) >= step] <= step)
    assert torch.equal(sparse.quantize([q])[0], q)
    # an offer scaled by hivemind's accumulator (x 7, then x 1/7) is a bit off: the payload carries the offer's values
    scaled = (q * 7) * (1 / 7)
    assert not torch.equal(scaled, q)
    idx, values = sparse.decode(sparse.encode(scaled, quantized=True), 3000, 600, quantized=True)
    assert torch.equal(values, q[idx])
    # the exponent range bounds what a payload can carry: finite, normal fp32
    assert sparse.quantize([torch.tensor([3e38, 0.0])])[0].tolist() == [127 * 2.0 ** 120, 0.0]
    assert sparse.quantize([torch.tensor([1e-40])])[0].tolist() == [2.0 ** -120]


def _payload(indices, values, magic=b"DSPR", count=None, layout=sparse.INDICES, kind=sparse.F32):
    """A payload with fp32 values (`kind` only labels them)."""
    count = len(indices) if count is None else count
    return (struct.pack("<4sIBB", magic, count, layout, kind) + np.array(indices, "<u4").tobytes()
            + np.array(values, "<f4").tobytes())


def _bitmask(bits: str, values, count=None):
    """A payload whose positions are the bitmask `bits` (element i is bits[i], padded with 0 to whole bytes)."""
    mask = np.packbits(np.array([b == "1" for b in bits]), bitorder="little").tobytes()
    count = len(values) if count is None else count
    return struct.pack("<4sIBB", b"DSPR", count, sparse.BITMASK, sparse.F32) + mask + np.array(values, "<f4").tobytes()


# indices for a model of 1,000 elements (8 bytes of indices < a 125-byte bitmask); a bitmask for one of 10 (2 bytes)
@pytest.mark.parametrize("data,total,why", [
    (b"DSP", 1000, "no header"),
    (_payload([1], [1.0], magic=b"XXXX"), 1000, "magic"),
    (_payload([1, 2, 3], [1.0, 1.0, 1.0]), 1000, "more than"),
    (_payload([1, 2], [1.0, 1.0], count=1), 1000, "bytes for"),
    (_payload([1, 1000], [1.0, 1.0]), 1000, "below 1000"),
    (_payload([4, 4], [1.0, 1.0]), 1000, "increase strictly"),
    (_payload([5, 4], [1.0, 1.0]), 1000, "increase strictly"),
    (_payload([1, 2], [1.0, float("nan")]), 1000, "finite"),
    (_payload([1, 2], [float("inf"), 1.0]), 1000, "finite"),
    (_payload([1, 2], [1.0, 1.0], kind=sparse.I8), 1000, "value type"),
    (_payload([1, 2], [1.0, 1.0]), 10, "layout"),  # indices where the bitmask is smaller
    (_bitmask("01" + "0" * 998, [1.0]), 1000, "layout"),  # a bitmask where indices are smaller
    (_bitmask("0100100000", [1.0, 2.0], count=1), 10, "bytes for"),
    (_bitmask("0100000000", [1.0, 2.0], count=2), 10, "marks 1 elements"),
    (_bitmask("0100000000000100", [1.0, 2.0]), 10, "at or past 10"),  # a padding bit set
    (_bitmask("0100100000", [1.0, float("nan")]), 10, "finite"),
])
def test_a_malformed_payload_is_refused(data, total, why):
    with pytest.raises(sparse.BadPayload, match=why):
        sparse.decode(data, total=total, limit=2)


def _quantized(exponent: int, values) -> bytes:
    """An 8-bit payload of a 1,000-element model at indices 1, 2, ..."""
    head = struct.pack("<4sIBB", b"DSPR", len(values), sparse.INDICES, sparse.I8)
    return (head + np.arange(1, len(values) + 1, dtype="<u4").tobytes() + struct.pack("<b", exponent)
            + np.array(values, np.int8).tobytes())


@pytest.mark.parametrize("data,why", [
    (_quantized(121, [1, 2]), "exponent"),
    (_quantized(-121, [1, 2]), "exponent"),
    (_quantized(0, [1, -128]), "-128"),
    (_quantized(0, [1, 2])[:-1], "bytes for"),
])
def test_a_malformed_8_bit_payload_is_refused(data, why):
    with pytest.raises(sparse.BadPayload, match=why):
        sparse.decode(data, total=1000, limit=2, quantized=True)
    assert sparse.decode(_quantized(120, [127, -1]), 1000, 2, quantized=True)[1].tolist() == [127 * 2.0 ** 120,
                                                                                            -(2.0 ** 120)]


def test_a_bitmask_payload_decodes_to_its_positions():
    idx, values = sparse.decode(_bitmask("0100100000", [1.0, -2.0]), total=10, limit=2)
    assert idx.tolist() == [1, 4] and values.tolist() == [1.0, -2.0]
    flat = torch.zeros(10)
    flat[[1, 4]] = torch.tensor([1.0, -2.0])
    assert sparse.encode(flat) == _bitmask("0100100000", [1.0, -2.0])  # one encoding per set of positions


def test_the_average_is_the_weighted_mean_and_the_same_bits_every_time():
    g = torch.Generator().manual_seed(0)
    flats = [sparse.top_k([torch.randn(5000, generator=g)], 0.05)[0] for _ in range(3)]
    payloads = [sparse.decode(sparse.encode(f), 5000, sparse.kept(5000, 0.05)) for f in flats]
    weights = [3.0, 1.0, 16.0]
    avg = sparse.average(payloads, weights, 5000)
    expected = sum(w * f.double() for w, f in zip(weights, flats)) / sum(weights)
    assert torch.allclose(avg.double(), expected, rtol=1e-6, atol=1e-7)
    again = sparse.average([(i.clone(), v.clone()) for i, v in payloads], list(weights), 5000)
    assert avg.numpy().tobytes() == again.numpy().tobytes()
    assert torch.equal(sparse.average(payloads, [0.0, 0.0, 0.0], 5000), torch.zeros(5000))
    with pytest.raises(ValueError):
        sparse.average(payloads, [1.0, -1.0, 1.0], 5000)
    with pytest.raises(ValueError):
        sparse.average(payloads, [1.0, float("nan"), 1.0], 5000)
    # decoded one at a time, as a round does: the same bits; every payload counted against the weights
    lazy = (sparse.decode(sparse.encode(f), 5000, sparse.kept(5000, 0.05)) for f in flats)
    assert sparse.average(lazy, weights, 5000).numpy().tobytes() == avg.numpy().tobytes()
    for short_or_long in (payloads[:2], payloads + payloads[:1]):
        with pytest.raises(ValueError, match="one weight per payload"):
            sparse.average(iter(short_or_long), weights, 5000)


def test_sparse_round_bytes_are_a_small_fraction_of_the_dense_ones():
    dense = codec.round_bytes("fp16", 1_000_000, 3)
    assert dense == allreduce_bytes(1_000_000, 3, 2.0) + allreduce_bytes(1_000_000, 3, 4.0)
    # top 1%: u32 indices and 8-bit values (an exponent per 64), 5.02 bytes per kept element; each member sends its
    # payload to the other two
    assert codec.round_bytes("sparse", 1_000_000, 3, 0.01) == pytest.approx(1_000_000 * 0.01 * (5 + 1 / 64) * 2)
    assert codec.round_bytes("sparse", 1_000_000, 1, 0.01) == 0.0
    # top 20%: a bitmask (1/8 byte per element) and 8-bit values
    assert codec.bytes_per_element("sparse", 0.2) == pytest.approx(0.125 + 0.2 * (1 + 1 / 64))


def _rounds(fraction):
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    return p, InnerRounds([p], torch.optim.SGD([p], lr=1.0), inner_steps=1, fraction=fraction)


def test_error_feedback_sends_everything_once_over_settled_rounds():
    p, r = _rounds(0.25)  # one element of four per round
    sent, trained = torch.zeros(4), torch.zeros(4)
    for g in ([4.0, 1.0, 0.5, 0.0], [0.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.25], [0.0] * 4, [0.0] * 4, [0.0] * 4):
        r.inner_step([torch.tensor(g)])  # SGD lr 1: the pseudo-gradient is g
        trained += torch.tensor(g)
        r.enter_outer()
        offer = r.offer(compress=True)[0].clone()
        assert int((offer != 0).sum()) <= 1
        assert r.offer() is r.offer() and torch.equal(r.offer()[0], offer)  # the same offer until the round ends
        with torch.no_grad():
            p.sub_(offer)  # an outer step that applied exactly the offer
        r.settle()
        sent += offer
    assert torch.equal(sent + r.feedback[0], trained)  # nothing dropped
    assert torch.equal(sent, trained)  # and, after enough rounds, everything sent, each element once


def test_a_missed_round_keeps_the_error_feedback_and_carries_the_pseudo_gradient():
    p, r = _rounds(0.25)
    r.inner_step([torch.tensor([2.0, 1.0, 0.0, 0.0])])
    r.enter_outer()
    r.offer(compress=True)
    r.settle()  # offered [2, 0, 0, 0]; [0, 1, 0, 0] waits in the error feedback
    assert torch.equal(r.feedback[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    r.inner_step([torch.tensor([0.0, 0.0, 3.0, 0.0])])
    r.enter_outer()
    assert torch.equal(r.offer(compress=True)[0], torch.tensor([0.0, 0.0, 3.0, 0.0]))
    with torch.no_grad():
        p.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))  # the swarm's bytes without this node's offer
    r.carry()
    assert torch.equal(r.feedback[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))  # unchanged
    assert torch.equal(r.pseudo_gradient()[0], torch.tensor([0.0, 0.0, 3.0, 0.0]))  # on the parameters, once
    r.enter_outer()
    assert torch.equal(r.offer(compress=False)[0], torch.tensor([0.0, 0.0, 3.0, 0.0]))  # alone: all of it


def test_a_fraction_outside_zero_one_is_refused():
    p = torch.nn.Parameter(torch.zeros(2))
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError):
            InnerRounds([p], torch.optim.SGD([p], lr=1.0), 1, fraction=bad)


_FEEDBACK_MEMORY = """
import json
import torch
from dtrain.node import memory
from dtrain.node.lowcomm.rounds import InnerRounds


def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


memory.cap_mmap_threshold()  # as the node runs: freed tensors leave
# a small round first: what a process's first round imports (torch's optimizer machinery, about 70 MiB) is not the
# feedback's
q = torch.nn.Parameter(torch.zeros(16))
q.grad = torch.zeros(16)
warm = InnerRounds([q], torch.optim.SGD([q], lr=1.0), inner_steps=1, fraction=0.25)
warm.inner_step([torch.ones(16)])
warm.enter_outer()
warm.offer(compress=True)
warm.settle()
n = 8 << 20  # 32 MiB
p = torch.nn.Parameter(torch.zeros(n))
p.grad, g = torch.zeros(n), torch.linspace(-1.0, 1.0, n)
before = anon_kib()
r = InnerRounds([p], torch.optim.SGD([p], lr=1.0), inner_steps=1, fraction=0.01)
before += (n * 4) >> 10  # the anchor's own copy (no snapshot is served here)
r.inner_step([g])
r.enter_outer()
offer = r.offer(compress=False)  # alone: the whole pseudo-gradient
with torch.no_grad():
    p.sub_(offer[0])
del offer
r.settle()
alone = anon_kib() - before
untouched = not r.feedback[0].any()
r.inner_step([g])
r.enter_outer()
offer = r.offer(compress=True)[0].clone()  # with peers: the top 1%, the rest waits in the feedback
with torch.no_grad():
    p.sub_(offer)
r.settle()
exact = torch.equal(r.feedback[0] + offer, g)
print(json.dumps([alone, untouched, exact, anon_kib() - before]))
"""


def test_the_error_feedback_holds_memory_only_once_a_round_left_something_unsent():
    # in a process of its own: a test worker's resident memory also moves with other tests' threads
    out = subprocess.run([sys.executable, "-c", _FEEDBACK_MEMORY], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    alone, untouched, exact, with_peers = json.loads(out.stdout.strip().splitlines()[-1])
    assert alone < 4 << 10  # the feedback stays untouched zeros
    assert untouched
    assert exact  # the unsent rest, exactly
    assert with_peers >= 30 << 10


def test_an_average_written_into_the_models_tensors_is_the_flat_average():
    rng = np.random.default_rng(7)
    shapes = [(3, 5), (1,), (40,), (7, 7), (2,)]
    total = sum(int(np.prod(s)) for s in shapes)
    payloads = []
    for _ in range(3):
        idx = np.sort(rng.choice(total, 20, replace=False))
        payloads.append((torch.from_numpy(idx), torch.from_numpy(rng.standard_normal(20).astype(np.float32))))
    weights = [2.0, 1.0, 5.0]
    out = [torch.full(s, float("nan")) for s in shapes]  # whatever the tensors held before: written whole
    sparse.average_into(payloads, weights, out)
    flat = torch.cat([t.reshape(-1) for t in out])
    assert flat.numpy().tobytes() == sparse.average(payloads, weights, total).numpy().tobytes()


def test_a_sparse_offer_is_top_k_of_pseudo_gradient_and_feedback_quantized_over_the_model():
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((64, 9), (5,), (300,), (1,))]
    r = InnerRounds(params, torch.optim.SGD(params, lr=0.3), inner_steps=1, fraction=0.1)
    with torch.no_grad():
        for e in r.feedback:
            e.copy_(torch.randn_like(e) * 0.01)
    r.inner_step([torch.randn_like(p) for p in params])
    r.enter_outer()
    offer = r.offer(compress=True)
    # the dense definition: top-k of each tensor, then quantized in blocks over the model's flat order
    dense = sparse.quantize_(sparse.top_k([e + (a - q) for e, a, q in zip(r.feedback, r.anchor,
                                                                           r.inner_parameters())], 0.1))
    assert len(offer) == len(dense)
    for o, d in zip(offer, dense):
        assert o.shape == d.shape and o.numpy().tobytes() == d.numpy().tobytes()
    assert offer[2].numpy().tobytes() == dense[2].numpy().tobytes()
    assert offer.payload == sparse.encode(dense, quantized=True)  # held as the bytes it sends, nothing dense
    # written into the gradient buffers times the step() calls: the bits of copying it dense and multiplying
    for compress in (True, False):
        buffers = [torch.full_like(p, 9.0) for p in params]
        r.write_offer(buffers, 3, compress=compress)
        for b, d in zip(buffers, r.offer()):
            assert b.numpy().tobytes() == (d * 3).numpy().tobytes()


def test_a_bitmask_decoded_piece_by_piece_gives_the_positions_of_one_pass(monkeypatch):
    rng = np.random.default_rng(11)
    flat = torch.from_numpy(np.where(rng.random(203) < 0.5, rng.standard_normal(203), 0.0).astype(np.float32))
    data = sparse.encode(flat)
    assert data[8] == sparse.BITMASK
    whole = sparse.decode(data, 203, 203)
    monkeypatch.setattr(sparse, "UNPACK_BYTES", 3)  # 24 elements at a time, the last piece short
    pieces = sparse.decode(data, 203, 203)
    assert pieces[0].dtype == torch.int32 and torch.equal(pieces[0], whole[0]) and torch.equal(pieces[1], whole[1])
    assert torch.equal(pieces[0].long(), torch.nonzero(flat).reshape(-1))
    with pytest.raises(sparse.BadPayload, match="at or past 10"):  # a padding bit, in a later piece
        sparse.decode(_bitmask("0100000000000100", [1.0, 2.0]), total=10, limit=2)
    monkeypatch.setattr(sparse, "UNPACK_BYTES", 1)
    with pytest.raises(sparse.BadPayload, match="marks more than"):  # found before the whole mask is read
        sparse.decode(_bitmask("1111111111", [1.0] * 3), total=10, limit=10)


@pytest.mark.parametrize("density, max_count", [(0.5, None), (0.01, None), (0.01, 5000)])  # bitmask, indices, and
def test_a_payload_built_tensor_by_tensor_is_the_payload_encode_makes(density, max_count):  # a bitmask turned to indices
    rng = np.random.default_rng(9)
    tensors = [torch.from_numpy(np.where(rng.random(n) < density, rng.standard_normal(n), 0.0).astype(np.float32))
               for n in (37, 1, 2500, 9, 7030)]
    count = sum(int(torch.count_nonzero(t)) for t in tensors)
    built = sparse.PayloadBuilder(sum(t.numel() for t in tensors), max_count or count)
    for t in tensors:
        idx = np.flatnonzero(t.numpy())
        built.add(idx, t.numpy()[idx], t.numel())
    for quantized in (False, True):
        assert built.payload(quantized) == sparse.encode(tensors, quantized)


@pytest.mark.parametrize("density", [0.5, 0.01])  # a bitmask, indices
@pytest.mark.parametrize("quantized", [False, True])
def test_a_payload_decoded_tensor_by_tensor_is_the_payload_decoded_whole(density, quantized):
    rng = np.random.default_rng(13)
    sizes = (37, 1, 2500, 9, 7030)
    tensors = [torch.from_numpy(np.where(rng.random(n) < density, rng.standard_normal(n), 0.0).astype(np.float32))
               for n in sizes]
    data = sparse.encode(tensors, quantized)
    idx, values = sparse.decode(data, sum(sizes), sum(sizes), quantized)
    parts = list(sparse.decode_tensors(data, sizes, quantized))
    starts = np.cumsum((0,) + sizes[:-1])
    assert np.array_equal(np.concatenate([local + s for (local, _), s in zip(parts, starts)]), idx.numpy())
    assert np.concatenate([v for _, v in parts]).tobytes() == values.numpy().tobytes()
    with pytest.raises(sparse.BadPayload):
        next(sparse.decode_tensors(data, sizes[:-1], quantized))  # another model's


def test_top_k_positions_are_the_largest_and_ties_keep_the_lower_positions():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 7, (10_000,), generator=g).float()  # a few values, so ties at the threshold everywhere
    for k in (1, 37, 2_500, 9_999, 10_000):
        idx = sparse.top_k_indices(x, k)
        assert idx.numel() == k and bool((idx[1:] > idx[:-1]).all())
        threshold = x[idx].min()
        assert bool((x[idx] >= threshold).all()) and int((x > threshold).sum()) <= k
        ties = torch.nonzero(x == threshold).squeeze(1)
        kept_ties = idx[x[idx] == threshold]
        assert torch.equal(kept_ties, ties[:kept_ties.numel()])  # the first ties, in order
    nan = torch.tensor([1.0, float("nan"), 3.0, 2.0])  # topk's answer: NaN counts largest
    assert torch.equal(sparse.top_k_indices(nan, 2), torch.topk(nan, 2).indices.sort().values)
