"""A round's group closes when the peers it expects are in it, and holds peers at one epoch (node.swarm.groupsize), on
two real hivemind gradient averagers with the commit step on 127.0.0.1. Member i holds the gradient i + 1
everywhere, so a result of 1.5 is the average of both."""
from __future__ import annotations

import time
from functools import partial

import pytest
import torch

from dtrain.node.swarm.commit import CommittingGradientAverager
from dtrain.node.swarm.groupsize import BehindTheSwarm
from tests.test_commit import applied, averagers

pytestmark = pytest.mark.swarm

MATCHMAKING_S = 6.0  # hivemind's leader keeps its group open this long unless the group is full
OPTS = dict(min_matchmaking_time=MATCHMAKING_S, allreduce_timeout=10.0, next_chunk_timeout=3.0, request_timeout=1.0,
            min_group_size=2)
STEP_TIMEOUT_S = 20.0


EPOCHS = [7, 7]  # each member's epoch, read when it schedules a round (SwarmOptimizer passes its local epoch)


@pytest.fixture(scope="module")
def pair():
    grads = [torch.full((1000,), float(i + 1)) for i in range(2)]
    factory = lambda i, owner: partial(CommittingGradientAverager, record_subkey=owner.subkey,
                                       round_epoch=lambda: EPOCHS[i])
    with averagers(factory, grads=grads, **OPTS) as members:
        yield members


def timed_round(members, expect: int) -> float:
    """One round in which every member expects `expect` peers (0: no expectation, hivemind's own matchmaking);
    asserts each member applied the average of both, returns the round's seconds."""
    for _, averager in members:
        averager.expect_group(expect)
        averager.accumulate_grads_(batch_size=1)
    began = time.monotonic()
    controls = [averager.step(wait=False, timeout=STEP_TIMEOUT_S, allow_retries=False) for _, averager in members]
    results = [control.result(2 * STEP_TIMEOUT_S) for control in controls]
    took = time.monotonic() - began
    for i, (result, (param, averager)) in enumerate(zip(results, members)):
        assert applied(result) and len(result) == 2, f"member {i}: {result}"
        with averager.use_averaged_gradients():
            assert torch.unique(param.grad).tolist() == [1.5], f"member {i} was not handed the average of both"
    return took


def test_the_group_closes_when_every_expected_peer_is_in_it(pair):
    waited = timed_round(pair, expect=0)
    assert waited >= MATCHMAKING_S - 1.5, f"without an expectation the group closed after {waited:.1f}s"
    closed = timed_round(pair, expect=2)
    assert closed < MATCHMAKING_S / 2, f"both peers were in the group, yet it closed after {closed:.1f}s"


def test_a_group_that_expected_more_peers_closes_at_its_time_with_those_who_came(pair):
    took = timed_round(pair, expect=3)
    assert took >= MATCHMAKING_S - 1.5, f"a group of 2 that expected 3 closed after {took:.1f}s"


def test_peers_at_different_epochs_find_no_group_and_at_one_epoch_average(pair):
    """Member 0 is one epoch behind: it would apply the other's gradient to its older parameters. Its round began
    first, so member 1 asks it to lead; turned away, member 1 finds no group, and member 0's round ends at once: the
    request told it the swarm is past its epoch, before any read of the swarm's records would."""
    EPOCHS[:] = [7, 8]
    for _, averager in pair:
        averager.expect_group(2)
        averager.accumulate_grads_(batch_size=1)
    behind = pair[0][1].step(wait=False, timeout=STEP_TIMEOUT_S, allow_retries=False)
    time.sleep(0.5)
    began = time.monotonic()
    ahead = pair[1][1].step(wait=False, timeout=MATCHMAKING_S + 2, allow_retries=False)
    with pytest.raises(BehindTheSwarm, match="epoch 8, this round at 7"):
        behind.result(STEP_TIMEOUT_S)
    heard = time.monotonic() - began
    assert heard < MATCHMAKING_S / 2, f"the round behind ended {heard:.1f}s after a peer at epoch 8 asked it"
    with pytest.raises(Exception, match="could not find a group"):
        ahead.result(2 * STEP_TIMEOUT_S)
    EPOCHS[:] = [8, 8]
    try:
        timed_round(pair, expect=2)  # the same two peers, at one epoch: the average of both
    finally:
        EPOCHS[:] = [7, 7]


def test_a_round_looking_for_a_group_ends_once_the_swarm_is_past_its_epoch(pair):
    """A peer whose round missed the others' group looks for one until its deadline; once its node reads that the
    swarm moved past the round's epoch, the round ends within a second, and the averager's next round, at the
    swarm's epoch, averages as before."""
    late, _ = pair[0][1], pair[1][1]
    late.accumulate_grads_(batch_size=1)
    began = time.monotonic()
    control = late.step(wait=False, timeout=STEP_TIMEOUT_S, allow_retries=False)  # at epoch 7, nobody else looking
    time.sleep(2.0)
    late.swarm_at(7)  # the swarm at the round's own epoch: it goes on looking
    time.sleep(1.0)
    assert not control.done(), control
    late.swarm_at(8)
    with pytest.raises(BehindTheSwarm, match="epoch 8"):
        control.result(STEP_TIMEOUT_S)
    took = time.monotonic() - began
    assert took < 5.0, f"the round ended {took:.1f}s after it began, not once the swarm moved on"
    EPOCHS[:] = [8, 8]
    try:
        timed_round(pair, expect=2)
    finally:
        EPOCHS[:] = [7, 7]
        late.swarm_at(-1)
