"""The sparse round's all-to-all exchange (node.lowcomm.gather) among real hivemind averagers on 127.0.0.1, two of
them client-mode peers that nobody can dial: every member ends the round with the same bits, the codec's average of
the four payloads, one of them the offer its node handed over instead of its `.grad`; and every member's record of
the round gives those bits. Who calls whom is tested in tests/test_gather_plan.py."""
from __future__ import annotations

import itertools
import tempfile
from functools import partial

import pytest
import torch

from dtrain.node.lowcomm import record, sparse
from dtrain.node.lowcomm.gather import SparseGatherAverager
from tests.test_commit import applied, averagers

pytestmark = pytest.mark.swarm


ELEMENTS, FRACTION = 200_000, 0.1
OPTS = dict(min_matchmaking_time=2.0, allreduce_timeout=20.0, request_timeout=2.0, target_group_size=4,
            min_group_size=4)


def members(client_mode):
    g = torch.Generator().manual_seed(0)
    grads = [sparse.quantize(sparse.top_k([torch.randn(ELEMENTS, generator=g)], FRACTION))[0] for _ in client_mode]
    return averagers(lambda i, owner: partial(SparseGatherAverager, fraction=FRACTION, record_subkey=owner.subkey,
                                              client_mode=client_mode[i]), grads, **OPTS)


def test_a_round_with_client_mode_members_ends_with_the_same_bits_on_every_member():
    limit = sparse.kept(ELEMENTS, FRACTION)
    with members([False, True, False, True]) as group:
        offers = [param.grad.clone() for param, _ in group]
        # the first member's node hands its averager the payload it built, and the averager sends it, not .grad
        offers[0] = sparse.quantize([offers[0] * -2.0])[0]
        group[0][1].round_files.hand_offer(sparse.encode(offers[0], quantized=True))
        for _, averager in group:
            averager.accumulate_grads_(batch_size=1)
        controls = [averager.step(wait=False, timeout=30.0, allow_retries=False) for _, averager in group]
        results = []
        for control, (param, averager) in zip(controls, group):
            result = control.result(60.0)
            assert applied(result), result
            with averager.use_averaged_gradients():
                results.append(param.grad.clone())
        records = []
        for _, averager in group:
            with tempfile.TemporaryFile() as f:
                averager.round_files.copy_record(f)
                f.seek(0)
                records.append(f.read())
    first = results[0].numpy().tobytes()
    assert all(r.numpy().tobytes() == first for r in results), "members ended the round with different bits"
    exact = torch.stack([o.double() for o in offers]).mean(0)
    assert torch.allclose(results[0].double(), exact, atol=1e-6)
    # and the bits are those of the codec's average of the four payloads, in some order of the group
    decoded = [sparse.decode(sparse.encode(o, quantized=True), ELEMENTS, sparse.kept(ELEMENTS, FRACTION),
                              quantized=True)
               for o in offers]
    assert any(sparse.average([decoded[i] for i in order], [1.0] * 4, ELEMENTS).numpy().tobytes() == first
               for order in itertools.permutations(range(4)))
    # each member's record of the round: the four payloads in the group's order, whose average is those bits
    assert len(set(records)) == 1
    members_of = record.parse(records[0], ELEMENTS, limit)
    payloads = {records[0][m.offset:m.offset + m.length] for m in members_of}
    assert payloads == {sparse.encode(o, quantized=True) for o in offers} and len(members_of) == 4
    out = torch.empty(ELEMENTS)
    record.average_into(records[0], members_of, [out], ELEMENTS, limit)
    assert out.numpy().tobytes() == first
