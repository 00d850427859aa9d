"""A low-comm round's group closes as soon as every peer it expects is in it, not when matchmaking's time is up.

hivemind's leader keeps its group open until the expiration it declared, `--matchmaking-time` after it began to look
(5 s by default), unless the group reaches `target_group_size`, which a swarm of changing size cannot fix in advance.
Two low-comm nodes then sat idle for those seconds at every outer round. The tracker knows how many peers are at the
swarm's epoch (node.swarm.tracker.PacedTracker), so before each round the node sets that count as the leader's target:
the group forms the moment the last of them joins.

A count that is too high costs what it always cost: the group closes at the declared expiration, with whoever came.
One that is too low (a peer the tracker did not see yet) closes the group without that peer, whose round then finds
no group; it carries its gradient into the next round, as any peer that came late to one. So only a peer that brings
samples to a low-comm round sets a target (node.swarm.optimizer.SwarmOptimizer._expect_group): full peers that join
only for client-mode peers' samples never close a group among themselves, which would be a round of no samples at all,
and per-step rounds keep their window, in which packets that reach other nodes join the same update.

A group also holds only peers at one epoch (`SameEpochGroup`). hivemind matches any peers that look for a group at
the same time, whatever epoch each is at, so a joiner that arrived just before the others' update joined their next
round one epoch behind: its update then differed from theirs, and because the group closed at the count the
leader expected, a peer at the right epoch was left out of it and updated alone (the churn bench, 20 Mbit/s).
Each gradient round now carries its peer's epoch in hivemind's gather data, and a leader turns away a follower at
another epoch; the peer behind finds no group, as any peer late to a round, and catches up.

A round that found no group would still look for one until its deadline (the all-reduce deadline, 38 s for the
default model at 10 Mbit/s), and hivemind 1.1.12 cannot cancel a round in matchmaking safely. Meanwhile the swarm
made two or three updates, which the peer then replayed, arriving late again: in a churn run at 20 Mbit/s a joiner
went round this loop for 17 minutes. So the node tells its averager the swarm's epoch (`swarm_at`) as its tracker
reads it, and as it reads it itself while it waits for its round (node.swarm.optimizer), and a round still
matchmaking at an older epoch ends with `BehindTheSwarm`, through the same path as any error of hivemind's
matchmaking (its group future fails; followers, if any, are sent away); the peer catches up at once. A leader also
learns it from the peers themselves: a follower that asks to join at a later epoch is turned away, and the leader's
round ends as if its node had read that epoch (the others' round began a read's interval, up to a second, before
the leader's node would see it). Only the round it heard this in ends: a stranger that claims a later epoch ends one
round of this peer, as one that joins and then fails it would, and the node catches up only to the epoch its own
reads of the swarm's records say.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
from typing import Callable, Optional

from hivemind.averaging.control import AveragingStage
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

WATCH_S = 0.25  # how often a round in matchmaking compares its epoch with the swarm's


class ExpectedGroup:
    """A hivemind averager whose matchmaking target is set per round, in the averager's own process (it reads it
    there), over the control pipe as hivemind's own set_group_bits does. The pipe keeps the order: a round scheduled
    after `expect_group` looks for a group with the new target."""

    _expected_size: Optional[int] = None

    def expect_group(self, peers: int) -> None:
        """The round about to be scheduled expects `peers` members, this one included (below 2: no target)."""
        size = peers if peers >= 2 else None
        if size != self._expected_size:
            self._expected_size = size
            self._outer_pipe.send(("_expect_group", [], dict(size=size)))

    async def _expect_group(self, size: Optional[int]) -> None:
        self._matchmaking.target_group_size = size


def epoch_of(data_for_gather: bytes) -> Optional[int]:
    """The epoch a peer's gradient round carries (hivemind's data for gather: bandwidth, mode, the user's bytes);
    None when it carries none."""
    try:
        _, _, user = MSGPackSerializer.loads(data_for_gather)
        epoch = MSGPackSerializer.loads(user)
    except Exception:
        return None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


class BehindTheSwarm(Exception):
    """A gradient round ended in matchmaking: the swarm is at a later epoch than the round."""


class SameEpochGroup:
    """A hivemind gradient averager whose groups hold peers at one epoch, and whose rounds end once the swarm is
    past their epoch (see the module docstring). `round_epoch` is the epoch of the peer's next round, read when the
    round is scheduled (the optimizer's local epoch)."""

    def __init__(self, *args, round_epoch: Callable[[], Optional[int]] = lambda: None, **kwargs):
        self._round_epoch = round_epoch
        self._swarm_epoch = mp.Value("q", -1, lock=False)  # written by the node, read in the averager's process
        self._heard_epoch = -1  # in the averager's process: the epoch a follower asked this round's group at, if later
        super().__init__(*args, **kwargs)

    def swarm_at(self, epoch: int) -> None:
        """The swarm's epoch as the node's tracker reads it (the node's process; one aligned word, no lock)."""
        self._swarm_epoch.value = int(epoch)

    def schedule_step(self, scheduled_time=None, **kwargs):
        if kwargs.get("gather") is None:
            kwargs["gather"] = self._round_epoch()
        return super().schedule_step(scheduled_time, **kwargs)

    async def _step(self, **kwargs):
        matchmaking = self._matchmaking
        if not getattr(matchmaking, "same_epoch_only", False):  # hivemind makes it in the averager's process
            checks = matchmaking._check_reasons_to_reject

            def check(request, context):
                return checks(request, context) or self._other_epoch(matchmaking.step_control, request)

            matchmaking._check_reasons_to_reject, matchmaking.same_epoch_only = check, True
        self._heard_epoch = -1  # one round at a time (hivemind's lock): what a follower said ends this one only
        watch = asyncio.create_task(self._end_when_behind(kwargs["step"]))
        try:
            return await super()._step(**kwargs)
        except BehindTheSwarm:
            return None  # the round's control holds it (hivemind set it before re-raising)
        finally:
            watch.cancel()

    def _other_epoch(self, leading, request) -> Optional[averaging_pb2.MessageFromLeader]:
        """`other_epoch`, and a follower at a later epoch is heard: this round is behind the swarm."""
        answer = other_epoch(leading, request)
        if answer is not None:
            ours, theirs = epoch_of(leading.data_for_gather), epoch_of(request.gather)
            if theirs > ours:  # bounded: the follower says only that some peer is past this round
                self._heard_epoch = max(self._heard_epoch, ours + 1)
        return answer

    async def _end_when_behind(self, step) -> None:
        ours = epoch_of(step.data_for_gather)
        if ours is None:
            return
        while not step.done():
            await asyncio.sleep(WATCH_S)
            swarm = max(self._swarm_epoch.value, self._heard_epoch)
            if swarm > ours and step.stage == AveragingStage.LOOKING_FOR_GROUP:
                group = self._matchmaking.assembled_group
                if not group.done():
                    group.set_exception(BehindTheSwarm(f"the swarm is at epoch {swarm}, this round at {ours}"))
                return


def other_epoch(leading, request) -> Optional[averaging_pb2.MessageFromLeader]:
    """A leader's answer to a follower whose round is at another epoch than its own (`leading`: the leader's
    StepControl); None when both are at one epoch, or either carries none."""
    if leading is None:
        return None
    ours, theirs = epoch_of(leading.data_for_gather), epoch_of(request.gather)
    if ours is None or theirs is None or ours == theirs:
        return None
    return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID)
