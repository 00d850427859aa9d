"""A state cut into ranges (node.lowcomm.ranges): the plan, the wire format of a range and its checks, ranges of
different epochs brought forward and assembled into the bits of the newest epoch's state, and a donor's answers
(node.lowcomm.statefetch) from its copy of one epoch."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from google.protobuf import wrappers_pb2

from dtrain.node.lowcomm import ranges, record, roundlog, sparse, statefetch
from dtrain.node.lowcomm.outer import OuterNesterov
from tests.test_roundlog import payload

pytestmark = pytest.mark.unit

SIZES = (300, 7, 1, 450, 242)  # a model of 1000 elements in tensors that the ranges cut across
TOTAL = sum(SIZES)
LR, MU = 0.7, 0.9


def test_the_plan_covers_the_state_once_in_order():
    for total, size in ((1000, 64), (1000, 1000), (1000, 3000), (1, 64), (129, 64)):
        plan = ranges.plan(total, size)
        assert plan[0].offset == 0 and plan[-1].end == total
        assert all(a.end == b.offset for a, b in zip(plan, plan[1:]))
        assert all(r.length == size for r in plan[:-1]) and 0 < plan[-1].length <= size
    assert ranges.plan(0) == []


def test_requests_are_bounded_to_the_model():
    r = ranges.Range(64, 64)
    assert ranges.parse_request(ranges.encode_request(r), TOTAL) == r
    for bad in (ranges.Range(990, 20), ranges.Range(0, 0), ranges.Range(0, ranges.MAX_RANGE_ELEMENTS + 1)):
        with pytest.raises(ranges.BadRange):
            ranges.parse_request(ranges.encode_request(bad), 10 ** 9 if bad.length > TOTAL else TOTAL)
    with pytest.raises(ranges.BadRange):
        ranges.parse_request(ranges.encode_request(r) + b"\0", TOTAL)


def test_a_piece_round_trips_and_every_malformed_answer_is_refused():
    r = ranges.Range(128, 64)
    piece = ranges.Piece(7, np.arange(64, dtype=np.float32), -np.arange(64, dtype=np.float32))
    data = ranges.encode_piece(r, piece)
    got = ranges.decode_piece(data, r, 5, 9)
    assert got.epoch == 7 and np.array_equal(got.params, piece.params) and np.array_equal(got.momentum, piece.momentum)

    nan = ranges.Piece(7, piece.params.copy(), piece.momentum.copy())
    nan.momentum[3] = np.inf
    bad = {
        "truncated": data[:-1],
        "longer": data + b"\0\0\0\0",
        "another range": ranges.encode_piece(ranges.Range(192, 64), piece),
        "an epoch too old": ranges.encode_piece(r, piece._replace(epoch=4)),
        "an epoch too new": ranges.encode_piece(r, piece._replace(epoch=10)),
        "non-finite": ranges.encode_piece(r, nan),
        "empty": b"",
    }
    for what, raw in bad.items():
        with pytest.raises(ranges.BadRange):
            ranges.decode_piece(raw, r, 5, 9)
            pytest.fail(what)


LIMIT = 150  # elements of a member's payload


def swarm_states(rounds: int, seed: int = 0):
    """The state (parameters, momentum) of every epoch 0..rounds of a swarm whose outer updates apply the averages
    of two members' sparse payloads, with the node's own OuterNesterov, the rounds as the log serves them and their
    averages (flat)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]
    outer = OuterNesterov(params, lr=LR, momentum=MU)
    for p in params:
        outer.state[p]["momentum_buffer"].copy_(torch.randn(p.numel(), generator=g))
        p.grad = torch.zeros_like(p)

    def state():
        flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts]).numpy().copy()
        return flat(params), flat(outer.state[p]["momentum_buffer"] for p in params)

    states, logged, averages = [state()], [], []
    for epoch in range(1, rounds + 1):
        members = [(8.0, payload(100 + epoch, count=LIMIT, total=TOTAL)),
                   (24.0, payload(200 + epoch, count=LIMIT, total=TOTAL))]
        flat = sparse.average([sparse.decode(p, TOTAL, LIMIT, quantized=True) for _, p in members],
                              [w for w, _ in members], TOTAL)
        for p, view in zip(params, flat.split(list(SIZES))):
            p.grad.copy_(view)
        outer.step()
        states.append(state())
        raw = record.encode(members)
        logged.append(roundlog.Round(epoch, raw, record.parse(raw, TOTAL, LIMIT)))
        averages.append((epoch, flat))
    return states, logged, averages


def piece_of(states, epoch: int, r: ranges.Range) -> ranges.Piece:
    params, momentum = states[epoch]
    return ranges.Piece(epoch, params[r.offset:r.end].copy(), momentum[r.offset:r.end].copy())


def test_a_range_brought_forward_is_that_range_of_the_newer_state_bit_for_bit():
    states, _, averages = swarm_states(6)
    for r in (ranges.Range(0, 1000), ranges.Range(3, 61), ranges.Range(299, 9), ranges.Range(999, 1)):
        for have in (0, 2, 5):
            got = ranges.bring_forward(r, piece_of(states, have, r), averages[have:], LR, MU)
            want = piece_of(states, 6, r)
            assert got.epoch == 6
            assert np.array_equal(got.params, want.params) and np.array_equal(got.momentum, want.momentum)
    with pytest.raises(ValueError):  # a round that does not follow the piece's epoch
        ranges.bring_forward(ranges.Range(0, 10), piece_of(states, 1, ranges.Range(0, 10)), averages[2:], LR, MU)


def test_ranges_of_different_epochs_assemble_into_the_newest_state():
    states, rounds, _ = swarm_states(5)
    assembly = ranges.Assembly(TOTAL, range_elements=96)
    epochs = [2, 5, 3, 4, 5, 2, 5, 3, 4, 5, 3]  # as donors at different epochs answered
    assert len(epochs) == len(assembly.ranges)
    for r, epoch in zip(assembly.ranges[:-1], epochs):
        assembly.add(r, piece_of(states, epoch, r))
    assert assembly.missing() == [assembly.ranges[-1]]
    params = [torch.zeros(n) for n in SIZES]
    momentum = [torch.zeros(n) for n in SIZES]
    with pytest.raises(ValueError):  # a range missing
        assembly.load_into(params, momentum)
    assembly.add(assembly.ranges[-1], piece_of(states, 3, assembly.ranges[-1]))
    with pytest.raises(ValueError):  # pieces of several epochs are not one state
        assembly.load_into(params, momentum)
    assert (assembly.oldest(), assembly.newest()) == (2, 5)
    assembly.bring_forward(rounds[2:], LIMIT, LR, MU)
    assert assembly.load_into(params, momentum) == 5
    assert np.array_equal(torch.cat(params).numpy(), states[5][0])
    assert np.array_equal(torch.cat(momentum).numpy(), states[5][1])

    with pytest.raises(ValueError):  # rounds that begin after a piece's next epoch
        stale = ranges.Assembly(TOTAL, range_elements=96)
        stale.add(stale.ranges[0], piece_of(states, 1, stale.ranges[0]))
        stale.bring_forward(rounds[3:], LIMIT, LR, MU)
    assert stale.drop_before(2) == 1 and stale.missing() == stale.ranges
    with pytest.raises(ValueError):  # a piece of another size than its range
        stale.add(stale.ranges[0], piece_of(states, 1, ranges.Range(0, 95)))


def test_a_donor_serves_one_epochs_momentum_in_place_and_answers_a_bad_request_with_nothing():
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(n, generator=g).numpy() for n in (70_000, 3, 130_000, 1_000)]
    momentum = [torch.randn(len(p), generator=g) for p in params]
    total = sum(len(p) for p in params)
    version = [0]  # the outer optimizer's (OuterNesterov.version): odd while a step writes the momentum
    donor = statefetch.RangeDonor(total, version=lambda: version[0], hold_wait_s=0.5)

    async def answer(raw: bytes, meanwhile=None) -> bytes:
        out = b""
        if meanwhile is not None:
            asyncio.get_running_loop().call_later(0.1, meanwhile)
        async for message in donor.serve(wrappers_pb2.BytesValue(value=raw), SimpleNamespace(remote_id="a peer")):
            out += message.value
        return out

    r = ranges.Range(69_990, 20)  # across the first two tensors and into the third
    request = ranges.encode_request(r)
    assert asyncio.run(answer(request)) == b""  # nothing held yet
    donor.hold(1, params, momentum)
    piece = ranges.decode_piece(asyncio.run(answer(request)), r, 1, 1)
    flat_p, flat_m = np.concatenate(params), torch.cat(momentum).numpy()
    assert np.array_equal(piece.params, flat_p[r.offset:r.end])
    assert np.array_equal(piece.momentum, flat_m[r.offset:r.end])

    version[0] += 1  # the node's next outer step moves the momentum in place...
    momentum[0].add_(1.0)
    version[0] += 1
    assert asyncio.run(answer(request)) == b""  # ...so it is no longer epoch 1's, and no epoch 2 came in time
    moved = torch.cat(momentum).numpy()
    assert not np.array_equal(moved[r.offset:r.end], flat_m[r.offset:r.end])
    # a request that arrives before the next snapshot is published is answered with that epoch's range
    piece = ranges.decode_piece(asyncio.run(answer(request, lambda: donor.hold(2, params, momentum))), r, 2, 2)
    assert piece.epoch == 2 and np.array_equal(piece.momentum, moved[r.offset:r.end])

    for bad in (ranges.encode_request(ranges.Range(total - 5, 10)), b"\0" * 3):
        assert asyncio.run(answer(bad)) == b""
    with pytest.raises(ValueError):
        donor.hold(3, params[:-1], momentum)
