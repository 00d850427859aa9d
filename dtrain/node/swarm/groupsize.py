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
"""
from __future__ import annotations

from typing import Optional


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
