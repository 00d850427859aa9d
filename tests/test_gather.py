"""The sparse round's all-to-all exchange (node.lowcomm.gather) among real hivemind averagers on 127.0.0.1, two of
them client-mode peers that nobody can dial: every member ends the round with the same bits, the codec's average of
the four payloads, one of them the offer its node handed over instead of its `.grad`; and every member's record of
the round gives those bits. A member behind the group's epoch commits the round, which the others average without
its payload, and applies nothing; when the members at the group's epoch are no majority, nobody applies it. Who calls whom is tested in tests/test_gather_plan.py."""
from __future__ import annotations

import itertools
import tempfile
from functools import partial

import pytest
import torch

from dtrain.node.lowcomm import record, sparse
from dtrain.node.lowcomm.gather import SparseGatherAverager
from dtrain.node.swarm.commit import AbortedRound
from tests.test_commit import applied, averagers

pytestmark = pytest.mark.swarm


ELEMENTS, FRACTION = 200_000, 0.1
OPTS = dict(min_matchmaking_time=2.0, allreduce_timeout=20.0, request_timeout=2.0)


def members(client_mode):
    g = torch.Generator().manual_seed(0)
    grads = [sparse.quantize(sparse.top_k([torch.randn(ELEMENTS, generator=g)], FRACTION))[0] for _ in client_mode]
    return averagers(lambda i, owner: partial(SparseGatherAverager, fraction=FRACTION, record_subkey=owner.subkey,
                                              client_mode=client_mode[i]), grads,
                     target_group_size=len(client_mode), min_group_size=len(client_mode), **OPTS)


def run(group):
    """One round of every member: (its result, its .grad after the round, its round file's record)."""
    for _, averager in group:
        averager.accumulate_grads_(batch_size=1)
    controls = [averager.step(wait=False, timeout=30.0, allow_retries=False) for _, averager in group]
    outcomes = []
    for control, (param, averager) in zip(controls, group):
        result = control.result(60.0)
        with averager.use_averaged_gradients():
            grad = param.grad.clone()
        with tempfile.TemporaryFile() as f:
            averager.round_files.copy_record(f)
            f.seek(0)
            outcomes.append((result, grad, f.read()))
    return outcomes


def codec_average(offers, order):
    limit = sparse.kept(ELEMENTS, FRACTION)
    decoded = [sparse.decode(sparse.encode(offers[i], quantized=True), ELEMENTS, limit, quantized=True)
               for i in order]
    return sparse.average(decoded, [1.0] * len(order), ELEMENTS).numpy().tobytes()


def test_a_round_with_client_mode_members_ends_with_the_same_bits_on_every_member():
    limit = sparse.kept(ELEMENTS, FRACTION)
    with members([False, True, False, True]) as group:
        offers = [param.grad.clone() for param, _ in group]
        # the first member's node hands its averager the payload it built, and the averager sends it, not .grad;
        # the others handed none (their epoch is unknown: they are averaged)
        offers[0] = sparse.quantize([offers[0] * -2.0])[0]
        group[0][1].round_files.hand_offer(3, sparse.encode(offers[0], quantized=True))
        outcomes = run(group)
    for result, _, _ in outcomes:
        assert applied(result), result
        assert len(result) == 4, f"the round averaged {len(result)} members' payloads, not the group's four"
    results = [grad for _, grad, _ in outcomes]
    records = [rec for _, _, rec in outcomes]
    first = results[0].numpy().tobytes()
    assert all(r.numpy().tobytes() == first for r in results), "members ended the round with different bits"
    exact = torch.stack([o.double() for o in offers]).mean(0)
    assert torch.allclose(results[0].double(), exact, atol=1e-6)
    # and the bits are those of the codec's average of the four payloads, in some order of the group
    assert any(codec_average(offers, order) == first for order in itertools.permutations(range(4)))
    # each member's record of the round: the four payloads in the group's order, whose average is those bits
    assert len(set(records)) == 1
    members_of = record.parse(records[0], ELEMENTS, limit)
    payloads = {records[0][m.offset:m.offset + m.length] for m in members_of}
    assert payloads == {sparse.encode(o, quantized=True) for o in offers} and len(members_of) == 4
    out = torch.empty(ELEMENTS)
    record.average_into(records[0], members_of, [out], ELEMENTS, limit)
    assert out.numpy().tobytes() == first


def test_a_member_behind_the_groups_epoch_is_left_out_of_the_average_and_applies_nothing():
    """Two members at epoch 8 and one still at 7 (it read the swarm's progress before the others' update): the two
    average their own payloads only, the same bits on both, and their record holds those two; the third's round
    tells it that it was behind, and its .grad is still its own offer."""
    limit = sparse.kept(ELEMENTS, FRACTION)
    with members([False, False, True]) as group:
        offers = [param.grad.clone() for param, _ in group]
        for (_, averager), offer, epoch in zip(group, offers, (8, 8, 7)):
            averager.round_files.hand_offer(epoch, sparse.encode(offer, quantized=True))
        outcomes = run(group)
    (r0, g0, rec0), (r1, g1, rec1), (behind, g2, _) = outcomes
    assert applied(r0) and applied(r1), (r0, r1)
    assert len(r0) == len(r1) == 2, "the members at the group's epoch averaged someone else's payload too"
    assert g0.numpy().tobytes() == g1.numpy().tobytes()
    assert g0.numpy().tobytes() in {codec_average(offers, order) for order in ((0, 1), (1, 0))}
    assert rec0 == rec1
    kept = record.parse(rec0, ELEMENTS, limit)
    assert {rec0[m.offset:m.offset + m.length] for m in kept} == {sparse.encode(o, quantized=True)
                                                                   for o in offers[:2]}
    assert isinstance(behind, AbortedRound) and behind.skip and behind.swarm_epoch == 9, behind
    assert torch.equal(g2, offers[2]), "the member behind had its .grad written by a round it does not apply"


def test_a_round_whose_members_at_the_groups_epoch_are_no_majority_is_applied_by_nobody():
    """One member at epoch 5 and one at 4: applied by the one at 5 alone, the round would put the other behind it
    again, and so on in rounds of one payload. Nobody applies it; the one behind learns the swarm is at 5."""
    with members([False, False]) as group:
        offers = [param.grad.clone() for param, _ in group]
        for (_, averager), offer, epoch in zip(group, offers, (5, 4)):
            averager.round_files.hand_offer(epoch, sparse.encode(offer, quantized=True))
        outcomes = run(group)
    for (result, grad, _), offer in zip(outcomes, offers):
        assert isinstance(result, AbortedRound) and result.skip and result.swarm_epoch == 5, result
        assert torch.equal(grad, offer), "a member had its .grad written by a round nobody applies"
