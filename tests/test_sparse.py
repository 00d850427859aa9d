"""The sparse wire codec (node.lowcomm.sparse) and the error feedback of a node's rounds (node.lowcomm.rounds):
top-k per tensor, payloads decoded to the same bits, every malformed payload refused, the average the same bits for
the same payloads, and the error feedback dropping nothing and sending nothing twice."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from dtrain.node.lowcomm import codec, sparse
from dtrain.node.lowcomm.rounds import InnerRounds

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
    assert len(data) == sparse.HEADER.size + sparse.BYTES_PER_KEPT * 4
    got_idx, got_values = sparse.decode(data, total=1000, limit=4)
    assert torch.equal(got_idx, idx) and torch.equal(got_values, flat[idx])
    assert sparse.decode(sparse.encode(torch.zeros(5)), total=5, limit=0)[0].numel() == 0


def _payload(indices, values, magic=b"DSPR", count=None):
    count = len(indices) if count is None else count
    return (struct.pack("<4sI", magic, count) + np.array(indices, "<u4").tobytes()
            + np.array(values, "<f4").tobytes())


@pytest.mark.parametrize("data,why", [
    (b"DSP", "no header"),
    (_payload([1], [1.0], magic=b"XXXX"), "magic"),
    (_payload([1, 2, 3], [1.0, 1.0, 1.0]), "more than"),
    (_payload([1, 2], [1.0, 1.0], count=1), "bytes for"),
    (_payload([1, 10], [1.0, 1.0]), "below 10"),
    (_payload([4, 4], [1.0, 1.0]), "increase strictly"),
    (_payload([5, 4], [1.0, 1.0]), "increase strictly"),
    (_payload([1, 2], [1.0, float("nan")]), "finite"),
    (_payload([1, 2], [float("inf"), 1.0]), "finite"),
])
def test_a_malformed_payload_is_refused(data, why):
    with pytest.raises(sparse.BadPayload, match=why):
        sparse.decode(data, total=10, limit=2)


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


def test_sparse_round_bytes_are_a_small_fraction_of_the_dense_ones():
    dense = codec.round_bytes("fp16", 1_000_000, 3)
    assert dense == codec.allreduce_bytes(1_000_000, 3, 2.0) + codec.allreduce_bytes(1_000_000, 3, 4.0)
    assert codec.round_bytes("sparse", 1_000_000, 3, 0.01) == 1_000_000 * 0.08 * 4
    assert codec.round_bytes("sparse", 1_000_000, 1, 0.01) == 0.0
    assert codec.bytes_per_element("sparse", 0.01) == pytest.approx(0.08)


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
        assert r.offer()[0] is r.offer()[0]  # the same tensors until the round ends
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
