"""The deadline of the swarm's next all-reduce, kept from each round's measured throughput (docs/low-communication.md,
"Deadlines that fit the link").

`round_sizes` says which bytes the deadline must fit and which bytes a round's exchange moved, per sync mode.
`RoundClock` runs on the training thread: after each gradient round it feeds the outcome into
node.lowcomm.deadline.RoundDeadlines, and node.swarm.optimizer.SwarmOptimizer.retime sets the next deadline on every
bound hivemind keeps of it, all to the same value, as the node has always configured them:
- hivemind.Optimizer's `averaging_timeout` (how long a round, and a state-averaging round, may look for a group) and
  `allreduce_timeout` (the wait for a round's outcome, on top of its matchmaking);
- each averager's `allreduce_timeout`, which its own process reads (the all-reduce's bound and, from it, the commit
  window: node.swarm.commit.commit_window), and the wait for a member's next chunk, which closes with the commit
  window (node.swarm.commit.chunk_timeout); `Retimable` sends them there over the averager's control pipe.
Its agreement waits (node.swarm.agreement) read the optimizer's `averaging_timeout` when they wait.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from hivemind.utils.logging import get_logger
from hivemind.utils.mpfuture import MPFuture

from dtrain.node.config import SwarmConfig
from dtrain.node.lowcomm import codec as lowcomm_codec
from dtrain.node.lowcomm.deadline import Deadline, RoundDeadlines, round_deadline

logger = get_logger(__name__)

DEADLINE_PEERS = 4  # the group size a round's deadline is sized for
# a state download's bytes per parameter: the parameters and the outer momentum (low-comm), or the parameters and
# both Adam moments (per-step), in fp32
STATE_BYTES_PER_ELEMENT = {"low-comm": 8.0, "per-step": 12.0}
RETIME_WAIT_S = 10.0  # bound on an averager's process taking a new deadline (it answers between its own tasks)
RETIME_MIN_CHANGE = 0.05  # a deadline that moved by less than this fraction is left as it is


@dataclass(frozen=True)
class RoundSizes:
    deadline_bytes: float  # what one member moves in the largest all-reduce of a round among DEADLINE_PEERS
    exchange_bytes: Callable[[int], float]  # what one member moved in a gradient exchange among n peers (measured)
    what: str  # for the log line at start


def round_sizes(swarm: SwarmConfig, elements: int) -> RoundSizes:
    if swarm.sync != "low-comm":
        # every update all-reduces the fp32 gradient, then the parameters and both Adam moments (three times its size)
        return RoundSizes(lowcomm_codec.allreduce_bytes(3 * elements, DEADLINE_PEERS, 4.0),
                          lambda peers: lowcomm_codec.allreduce_bytes(elements, peers, 4.0),
                          "the gradient, then the parameters and Adam moments, in fp32")
    if swarm.wire_codec == "sparse":  # every member sends its payload to every other member
        def sparse_bytes(peers: int) -> float:
            return lowcomm_codec.round_bytes("sparse", elements, peers, swarm.topk_fraction)
        return RoundSizes(sparse_bytes(DEADLINE_PEERS), sparse_bytes,
                          f"top-{swarm.topk_fraction:g} sparse payloads with error feedback")
    per_value = lowcomm_codec.bytes_per_element(swarm.wire_codec)
    return RoundSizes(elements * max(per_value, lowcomm_codec.PARAMS_BYTES),
                      lambda peers: lowcomm_codec.allreduce_bytes(elements, peers, per_value), swarm.wire_codec)


def swarm_deadlines(swarm: SwarmConfig, elements: int) -> tuple[SwarmConfig, RoundDeadlines, RoundSizes]:
    """The swarm's config with the first round's deadline as its averaging timeout and a state download's bound as
    its load timeout, the deadlines that follow and the sizes they are computed from. --averaging-timeout and the
    load timeout are floors; --link-mbit is a low-comm rate. (A bound sized for loopback cut GPT-2 small's first
    download, 1 GB over a 20 Mbit/s uplink, every 120 s, and it started over each time.)"""
    sizes = round_sizes(swarm, elements)
    link_mbit = swarm.link_mbit if swarm.sync == "low-comm" else 0.0
    deadlines = RoundDeadlines(sizes.deadline_bytes, swarm.averaging_timeout_s, link_mbit)
    first = deadlines.current()
    download = round_deadline(elements * STATE_BYTES_PER_ELEMENT[swarm.sync], swarm.load_state_timeout_s, link_mbit)
    if swarm.sync == "low-comm":
        logger.info(f"low-comm: {swarm.inner_steps} inner updates per outer round, pseudo-gradient in "
                    f"{sizes.what}; all-reduce deadline {first.seconds:.0f}s from {first.why}; a state download "
                    f"may take {download.seconds:.0f}s, from {download.why}")
    return (dataclasses.replace(swarm, averaging_timeout_s=first.seconds, load_state_timeout_s=download.seconds),
            deadlines, sizes)


class Retimable:
    """An averager whose all-reduce bounds can change between rounds. hivemind reads them in the averager's own
    process, so the new ones travel over the control pipe, as hivemind's own set_group_bits does; a round already
    running keeps the bounds it began with."""

    def set_allreduce_timeout(self, seconds: float, chunk_s: float) -> None:
        """`seconds`: the all-reduce's bound; `chunk_s`: how long a member's next chunk may take (of a round, and of
        a state download: node.swarm.commit.chunk_timeout)."""
        self._retime(seconds, chunk_s)
        future = MPFuture()
        self._outer_pipe.send(("_set_allreduce_timeout", [], dict(seconds=seconds, chunk_s=chunk_s, future=future)))
        future.result(RETIME_WAIT_S)

    async def _set_allreduce_timeout(self, seconds: float, chunk_s: float, future: MPFuture) -> None:
        self._retime(seconds, chunk_s)
        future.set_result(None)

    def _retime(self, seconds: float, chunk_s: float) -> None:
        # as hivemind's constructor derives them: a sender's chunk, and a reducer's answer twice that
        self._allreduce_timeout, self.next_chunk_timeout = seconds, chunk_s
        self.allreduce_kwargs.update(sender_timeout=chunk_s, reducer_timeout=2 * chunk_s)


class RoundClock:
    """Measured rounds in, the next deadline out (training thread only). `deadline` is the one the swarm's bounds
    hold; a method that returns a Deadline asks the caller to set it on them (SwarmOptimizer.retime)."""

    def __init__(self, deadlines: RoundDeadlines, sizes: RoundSizes):
        self.deadlines, self.sizes = deadlines, sizes
        self.deadline: Deadline = deadlines.current()

    def completed(self, peers: int, exchange_s: float) -> Optional[Deadline]:
        """A committed round among `peers` whose exchange took `exchange_s`: the next deadline, if it moved."""
        self.deadlines.completed(self.sizes.exchange_bytes(peers), exchange_s)
        return self._moved()

    def ran_out(self) -> tuple[Deadline, Optional[Deadline]]:
        """A round ran out of time: (the deadline it had, for its log line; the next one, longer)."""
        spent = self.deadline
        self.deadlines.ran_out(spent.seconds)
        return spent, self._moved()

    def _moved(self) -> Optional[Deadline]:
        new = self.deadlines.current()
        if abs(new.seconds - self.deadline.seconds) <= RETIME_MIN_CHANGE * self.deadline.seconds:
            return None
        logger.info(f"All-reduce deadline {self.deadline.seconds:.0f}s -> {new.seconds:.0f}s, from {new.why}")
        self.deadline = new
        return new
