"""A state cut into ranges (node.lowcomm.ranges): the plan, the wire format of a range and its checks, ranges of
different epochs brought forward and assembled into the bits of the newest epoch's state, and a donor's answers
(node.lowcomm.statefetch) from its copy of one epoch."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from google.protobuf import wrappers_pb2

from dtrain.node.lowcomm import momentum as momentum8
from dtrain.node.lowcomm import ranges, record, roundlog, sparse, statefetch
from dtrain.node.lowcomm.outer import OuterNesterov
from tests.test_roundlog import payload

pytestmark = pytest.mark.unit

SIZES = (300, 7, 1, 450, 242)  # a model of 1000 elements in tensors that the ranges cut across
TOTAL = sum(SIZES)
LAYOUT = ranges.StateLayout(SIZES)
LR, MU = 0.7, 0.9
BLOCK = momentum8.BLOCK


def boundaries(sizes) -> set:
    """Every element where a momentum block begins, and the end of the state."""
    starts = np.cumsum((0,) + tuple(sizes[:-1]))
    return {int(s) + k for s, n in zip(starts, sizes) for k in range(0, n, BLOCK)} | {sum(sizes)}


def test_the_plan_covers_the_state_once_in_order_in_whole_blocks():
    for sizes in (SIZES, (1,), (129,), (70_000, 3, 130_000, 1_000), (0, 600, 0, 5)):
        layout, edges = ranges.StateLayout(sizes), boundaries(sizes)
        assert all(layout.on_boundary(x) == (x in edges) for x in range(sum(sizes) + 1))
        for size in (1, 64, 256, 300, 1000, 3000, ranges.RANGE_ELEMENTS):
            plan = layout.plan(size)
            assert plan[0].offset == 0 and plan[-1].end == sum(sizes)
            assert all(a.end == b.offset for a, b in zip(plan, plan[1:]))
            for r in plan:
                assert r.offset in edges and r.end in edges
                after = min(e for e in edges if e > r.offset)  # the block it begins with
                # as long as it may be, and no longer: the next boundary after it is beyond `size`
                assert r.length <= size or r.end == after
                assert r.end == sum(sizes) or min(e for e in edges if e > r.end) > r.offset + size or r.end == after
                assert layout.scale_count(r) == sum(p.end_scale - p.first_scale for p in layout.parts(r))
    assert ranges.StateLayout(()).plan() == []
    # the parts of a range: its share of each tensor, each beginning on a block of that tensor
    assert LAYOUT.parts(ranges.Range(256, 308)) == [ranges.Part(0, 256, 300), ranges.Part(1, 0, 7),
                                                     ranges.Part(2, 0, 1), ranges.Part(3, 0, 256)]


def test_requests_are_bounded_to_the_model_and_to_whole_blocks():
    r = ranges.Range(256, 52)
    assert LAYOUT.parse_request(ranges.encode_request(r)) == r
    for bad in (ranges.Range(990, 20), ranges.Range(0, 0), ranges.Range(0, ranges.MAX_RANGE_ELEMENTS + 1),
                ranges.Range(3, 61), ranges.Range(0, 100)):
        layout = ranges.StateLayout((10 ** 9,)) if bad.length > TOTAL else LAYOUT
        with pytest.raises(ranges.BadRange):
            layout.parse_request(ranges.encode_request(bad))
    with pytest.raises(ranges.BadRange):
        LAYOUT.parse_request(ranges.encode_request(r) + b"\0")


def test_a_piece_round_trips_and_every_malformed_answer_is_refused():
    r = ranges.Range(256, 308)  # the tail of tensor 0, tensors 1 and 2, the first block of tensor 3: four scales
    scales = np.array([0.5, 0.0, 2.0, 1e-3], np.float32)
    piece = ranges.Piece(7, np.arange(308, dtype=np.float32), (np.arange(308) % 255 - 127).astype(np.int8), scales)
    data = ranges.encode_piece(r, piece)
    assert len(data) == LAYOUT.answer_bytes(r) == ranges.HEADER.size + 5 * 308 + 4 * 4
    got = LAYOUT.decode_piece(data, r, 5, 9)
    assert got.epoch == 7 and all(np.array_equal(a, b) for a, b in zip(got[1:], piece[1:]))

    def spoilt(**change) -> bytes:
        fields = {"params": piece.params.copy(), "codes": piece.codes.copy(), "scales": piece.scales.copy()}
        for key, (index, value) in change.items():
            fields[key][index] = value
        return ranges.encode_piece(r, piece._replace(**fields))

    bad = {
        "truncated": data[:-1],
        "longer": data + b"\0\0\0\0",
        "another range": ranges.encode_piece(ranges.Range(0, 308), piece),
        "an epoch too old": ranges.encode_piece(r, piece._replace(epoch=4)),
        "an epoch too new": ranges.encode_piece(r, piece._replace(epoch=10)),
        "a non-finite parameter": spoilt(params=(3, np.inf)),
        "a non-finite scale": spoilt(scales=(1, np.nan)),
        "a negative scale": spoilt(scales=(2, -1.0)),
        "a scale whose codes overflow": spoilt(scales=(0, 3e38)),
        "a code outside the 8-bit form": spoilt(codes=(5, -128)),
        "empty": b"",
    }
    for what, raw in bad.items():
        with pytest.raises(ranges.BadRange):
            LAYOUT.decode_piece(raw, r, 5, 9)
            pytest.fail(what)


LIMIT = 150  # elements of a member's payload


def swarm_states(rounds: int, seed: int = 0):
    """The state (per tensor: parameters, momentum codes, momentum scales) of every epoch 0..rounds of a swarm whose
    outer updates apply the averages of two members' sparse payloads, with the node's own OuterNesterov, the rounds
    as the log serves them and their averages (flat)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]
    outer = OuterNesterov(params, lr=LR, momentum=MU)
    for p in params:
        momentum8.quantize_(torch.randn(p.numel(), generator=g), outer.state[p]["momentum_codes"],
                            outer.state[p]["momentum_scales"])
        p.grad = torch.zeros_like(p)

    def state():
        return ([p.detach().numpy().copy() for p in params],
                [outer.state[p]["momentum_codes"].numpy().copy() for p in params],
                [outer.state[p]["momentum_scales"].numpy().copy() for p in params])

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
    params, codes, scales = states[epoch]
    parts = LAYOUT.parts(r)
    return ranges.Piece(epoch, np.concatenate([params[t][lo:hi] for t, lo, hi in parts]),
                        np.concatenate([codes[t][lo:hi] for t, lo, hi in parts]),
                        np.concatenate([scales[p.tensor][p.first_scale:p.end_scale] for p in parts]))


def same(a: ranges.Piece, b: ranges.Piece) -> bool:
    return a.epoch == b.epoch and all(x.tobytes() == y.tobytes() for x, y in zip(a[1:], b[1:]))


def test_a_range_brought_forward_is_that_range_of_the_newer_state_bit_for_bit():
    states, _, averages = swarm_states(6)
    for r in (ranges.Range(0, 1000), ranges.Range(256, 308), ranges.Range(300, 8), ranges.Range(564, 194),
              ranges.Range(758, 242)):
        for have in (0, 2, 5):
            got = LAYOUT.bring_forward(r, piece_of(states, have, r), averages[have:], LR, MU)
            assert same(got, piece_of(states, 6, r))
    assert not same(piece_of(states, 5, ranges.Range(0, 1000)), piece_of(states, 6, ranges.Range(0, 1000)))
    with pytest.raises(ValueError):  # a round that does not follow the piece's epoch
        LAYOUT.bring_forward(ranges.Range(0, 256), piece_of(states, 1, ranges.Range(0, 256)), averages[2:], LR, MU)


def test_ranges_of_different_epochs_assemble_into_the_newest_state():
    states, rounds, _ = swarm_states(5)
    assembly = ranges.Assembly(LAYOUT, range_elements=96)  # a block each, or the small tensors' blocks together
    assert [r.end for r in assembly.ranges] == [256, 308, 564, 758, 1000]
    epochs = [2, 5, 4, 5]  # as donors at different epochs answered
    assert len(epochs) == len(assembly.ranges) - 1
    for r, epoch in zip(assembly.ranges[:-1], epochs):
        assembly.add(r, piece_of(states, epoch, r))
    assert assembly.missing() == [assembly.ranges[-1]]
    params, (codes, scales) = [torch.zeros(n) for n in SIZES], zip(*(momentum8.zeros(torch.zeros(n)) for n in SIZES))
    with pytest.raises(ValueError):  # a range missing
        assembly.load_into(params, codes, scales)
    assembly.add(assembly.ranges[-1], piece_of(states, 3, assembly.ranges[-1]))
    with pytest.raises(ValueError):  # pieces of several epochs are not one state
        assembly.load_into(params, codes, scales)
    assert (assembly.oldest(), assembly.newest()) == (2, 5)
    assembly.bring_forward(rounds[2:], LIMIT, LR, MU)
    assert assembly.load_into(params, codes, scales) == 5
    for got, want in zip((params, codes, scales), states[5]):
        assert [t.numpy().tobytes() for t in got] == [a.tobytes() for a in want]

    with pytest.raises(ValueError):  # rounds that begin after a piece's next epoch
        stale = ranges.Assembly(LAYOUT, range_elements=96)
        stale.add(stale.ranges[0], piece_of(states, 1, stale.ranges[0]))
        stale.bring_forward(rounds[3:], LIMIT, LR, MU)
    assert stale.drop_before(2) == 1 and stale.missing() == stale.ranges
    with pytest.raises(ValueError):  # a piece of another size than its range
        stale.add(stale.ranges[0], piece_of(states, 1, ranges.Range(0, 300)))


def test_a_donor_serves_one_epochs_momentum_in_place_and_answers_a_bad_request_with_nothing():
    g = torch.Generator().manual_seed(1)
    sizes = (70_000, 3, 130_000, 1_000)
    layout = ranges.StateLayout(sizes)
    params = [torch.randn(n, generator=g).numpy() for n in sizes]
    codes, scales = zip(*(momentum8.zeros(torch.zeros(n)) for n in sizes))
    for c, sc in zip(codes, scales):
        momentum8.quantize_(torch.randn(c.numel(), generator=g), c, sc)
    version = [0]  # the outer optimizer's (OuterNesterov.version): odd while a step writes the momentum
    # in place only (no copy while joiners download: below)
    donor = statefetch.RangeDonor(layout, version=lambda: version[0], hold_wait_s=0.5, serving_s=0.0)

    async def answer(raw: bytes, meanwhile=None, by=None) -> bytes:
        out = b""
        if meanwhile is not None:
            asyncio.get_running_loop().call_later(0.1, meanwhile)
        async for message in (by or donor).serve(wrappers_pb2.BytesValue(value=raw), SimpleNamespace(remote_id="a peer")):
            out += message.value
        return out

    r = ranges.Range(69_888, 371)  # the last block of the first tensor, the second, the first block of the third
    assert layout.parts(r) == [ranges.Part(0, 69_888, 70_000), ranges.Part(1, 0, 3), ranges.Part(2, 0, 256)]
    request = ranges.encode_request(r)
    assert asyncio.run(answer(request)) == b""  # nothing held yet
    donor.hold(1, params, codes, scales)
    piece = layout.decode_piece(asyncio.run(answer(request)), r, 1, 1)
    assert piece.params.tobytes() == params[0][69_888:].tobytes() + params[1].tobytes() + params[2][:256].tobytes()
    assert piece.codes.tobytes() == (codes[0][69_888:].numpy().tobytes() + codes[1].numpy().tobytes()
                                     + codes[2][:256].numpy().tobytes())
    assert piece.scales.tolist() == [scales[0][-1].item(), scales[1][0].item(), scales[2][0].item()]

    version[0] += 1  # the node's next outer step moves the momentum in place...
    scales[0].mul_(2.0)
    version[0] += 1
    assert asyncio.run(answer(request)) == b""  # ...so it is no longer epoch 1's, and no epoch 2 came in time
    # a request that arrives before the next snapshot is published is answered with that epoch's range
    piece = layout.decode_piece(asyncio.run(answer(request, lambda: donor.hold(2, params, codes, scales))), r, 2, 2)
    assert piece.epoch == 2 and piece.scales[0] == scales[0][-1].item() != 0

    # a donor asked for ranges in the last serving_s copies each epoch's momentum as it is published: its answers go
    # on through the outer step after it, with that epoch's bytes, not the step's
    copying = statefetch.RangeDonor(layout, version=lambda: version[0], hold_wait_s=0.5, serving_s=1.0)
    copying.hold(3, params, codes, scales)  # nobody asked yet: in place
    assert not copying.serving()  # nobody downloads from it (the node may be alone: TrainingNode.alone)
    version[0] += 2
    assert asyncio.run(answer(request, by=copying)) == b""
    assert copying.serving()  # a joiner asked, even with nothing to answer
    copying.hold(4, params, codes, scales)  # asked a moment ago: copied
    before = (codes[0][-1].item(), scales[0][-1].item())
    version[0] += 1  # an outer step under way...
    codes[0].neg_()
    scales[0].mul_(3.0)
    piece = layout.decode_piece(asyncio.run(answer(request, by=copying)), r, 4, 4)
    assert piece.epoch == 4 and (int(piece.codes[111]), float(piece.scales[0])) == before
    assert (codes[0][-1].item(), scales[0][-1].item()) != before  # ...which moved the optimizer's own tensors
    version[0] += 1
    time.sleep(1.0)  # nobody asked since: the next epoch is read in place again
    assert not copying.serving()
    copying.hold(5, params, codes, scales)
    version[0] += 2
    assert asyncio.run(answer(request, by=copying)) == b""

    total = sum(sizes)
    for bad in (ranges.encode_request(ranges.Range(total - 5, 10)), ranges.encode_request(ranges.Range(1, 255)),
                b"\0" * 3):
        assert asyncio.run(answer(bad)) == b""
    with pytest.raises(ValueError):
        donor.hold(3, params[:-1], codes, scales)
