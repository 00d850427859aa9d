"""The deadline of the swarm's next all-reduce: sized for the bytes of a round at the link's rate, and kept from each
round's measured throughput (docs/low-communication.md, "Deadlines that fit the link").

A window sized for loopback aborts every round of a large model over a home uplink (GPT-2 small's full gradient is
about 250 MB in fp16: more than 100 s at 20 Mbit/s). The deadline of one all-reduce is the time its bytes take at
the slower of the configured link rate and the measured throughput of earlier rounds, times a margin, and never
below the configured floor.

`RoundDeadlines` is the feedback loop: every completed round measures the throughput of its exchange (the transfer,
not the matchmaking before it nor the commit step after it), and the next round's deadline uses it. A measurement
can only lengthen a deadline below what --link-mbit gives (the slower rate wins), so a fast first round followed by
a slower link never leaves a deadline too short for the configured rate. A round that ran out of time measures
nothing, so it doubles the next deadline instead (up to 16 times the first): a link slower than both rates gets
rounds long enough to complete, and then a measurement.

`RoundSizes` says which bytes the deadline must fit and which bytes a round's exchange moved: `per_step_sizes` here,
node.lowcomm.codec.round_sizes for the low-comm codecs (the node picks).
`RoundClock` runs on the training thread: after each gradient round it feeds the outcome into `RoundDeadlines`, and
node.swarm.optimizer.SwarmOptimizer.retime sets the next deadline on every bound hivemind keeps of it, all to the
same value, as the node has always configured them:
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

logger = get_logger(__name__)

DEADLINE_PEERS = 4  # the group size a round's deadline is sized for
# a state download's bytes per parameter: the f32 parameters and the outer momentum in 8 bits (low-comm:
# node.lowcomm.momentum.STATE_BYTES_PER_ELEMENT), or the parameters and both Adam moments in f32 (per-step)
STATE_BYTES_PER_ELEMENT = {"low-comm": 4 + 1 + 4 / 256, "per-step": 12.0}
RETIME_WAIT_S = 10.0  # bound on an averager's process taking a new deadline (it answers between its own tasks)
RETIME_MIN_CHANGE = 0.05  # a deadline that moved by less than this fraction is left as it is
MARGIN = 3.0  # a round may take this many times its bytes' transfer time: TCP ramp-up, uneven peers, a busy host
SMOOTHING = 0.5  # weight of the newest throughput measurement in the running estimate
GROWTH = 2.0  # a round that ran out of time makes the next deadline this many times as long
MAX_GROWTH = 16.0  # rounds that run out grow it to at most this many times the first (measured rounds go further)


@dataclass(frozen=True)
class Deadline:
    seconds: float
    why: str  # how it was derived, for the log line of a round that is aborted


def round_deadline(bytes_each_way: float, floor_s: float, link_mbit: float = 0.0,
                   measured_bps: Optional[float] = None, measured: str = "measured") -> Deadline:
    """Seconds one all-reduce may take. `link_mbit` 0: no configured rate; `measured_bps`: bytes/s seen so far
    (`measured`: how it was known, for `why`)."""
    rates = []
    if link_mbit > 0:
        rates.append((link_mbit * 1e6 / 8, f"the link's {link_mbit:g} Mbit/s"))
    if measured_bps:
        rates.append((measured_bps, f"{measured_bps * 8 / 1e6:.3g} Mbit/s {measured}"))
    if not rates or bytes_each_way <= 0:
        return Deadline(floor_s, f"the configured {floor_s:g}s (no rate known)")
    rate, source = min(rates)
    need = MARGIN * bytes_each_way / rate
    if need <= floor_s:
        return Deadline(floor_s, f"the configured {floor_s:g}s ({bytes_each_way / 1e6:.3g} MB at {source} "
                                 f"needs {need:.1f}s with margin)")
    return Deadline(need, f"{bytes_each_way / 1e6:.3g} MB at {source}, x{MARGIN:g}")


class Throughput:
    """Running estimate of the bytes per second a completed round moved (none before the first)."""

    def __init__(self):
        self.bps: Optional[float] = None
        self.known = "measured"  # how the estimate was last set: a measurement, or a round that ran out of time

    def observe(self, bytes_moved: float, seconds: float) -> None:
        if bytes_moved <= 0 or not seconds > 0:
            return
        sample = bytes_moved / seconds
        self.bps = sample if self.bps is None else SMOOTHING * sample + (1 - SMOOTHING) * self.bps
        self.known = "measured"

    def at_most(self, bps: float) -> None:
        """The throughput is known to be below `bps` (a round that did not finish in time)."""
        if bps > 0 and (self.bps is None or bps < self.bps):
            self.bps, self.known = bps, "at most (a round ran out of time)"


class RoundDeadlines:
    """The deadline of the next round, sized for `sized_bytes` (what one member moves in the largest round the
    deadline must fit), from --link-mbit and what earlier rounds measured; the floor is the configured timeout."""

    def __init__(self, sized_bytes: float, floor_s: float, link_mbit: float = 0.0):
        self.sized_bytes, self.floor_s, self.link_mbit = sized_bytes, floor_s, link_mbit
        self.throughput = Throughput()
        self.first_s = self.current().seconds

    def current(self) -> Deadline:
        return round_deadline(self.sized_bytes, self.floor_s, self.link_mbit, self.throughput.bps,
                              self.throughput.known)

    def completed(self, bytes_moved: float, seconds: float) -> None:
        """A round completed: its exchange moved `bytes_moved` (this member's side) in `seconds`."""
        self.throughput.observe(bytes_moved, seconds)

    def ran_out(self, deadline_s: float) -> None:
        """A round with a deadline of `deadline_s` ran out of time: the next one gets GROWTH times as long, up to
        MAX_GROWTH times the first (a member frozen in every round would otherwise stretch them without end). The
        estimate drops to the rate that gives it (never rises: a rate it already knows to be slower stands)."""
        target = min(GROWTH * deadline_s, MAX_GROWTH * self.first_s)
        if self.sized_bytes > 0 and target > 0:
            self.throughput.at_most(MARGIN * self.sized_bytes / target)


@dataclass(frozen=True)
class RoundSizes:
    deadline_bytes: float  # what one member moves in the largest all-reduce of a round among DEADLINE_PEERS
    exchange_bytes: Callable[[int], float]  # what one member moved in a gradient exchange among n peers (measured)
    what: str  # for the log line at start


def allreduce_bytes(elements: int, peers: int, bytes_per_value: float) -> float:
    """Bytes one peer sends (and as many it receives) in one butterfly all-reduce of `elements` values among
    `peers`: it sends every other reducer its part and returns every sender the average of its own part."""
    if peers <= 1:
        return 0.0
    return 2.0 * elements * bytes_per_value * (peers - 1) / peers


def per_step_sizes(elements: int) -> RoundSizes:
    """Per-step mode: every update all-reduces the fp32 gradient, then the parameters and both Adam moments (three
    times its size)."""
    return RoundSizes(allreduce_bytes(3 * elements, DEADLINE_PEERS, 4.0),
                      lambda peers: allreduce_bytes(elements, peers, 4.0),
                      "the gradient, then the parameters and Adam moments, in fp32")


def swarm_deadlines(swarm: SwarmConfig, elements: int, sizes: RoundSizes) -> tuple[SwarmConfig, RoundDeadlines]:
    """The swarm's config with the first round's deadline (for rounds of `sizes`) as its averaging timeout and a
    state download's bound as its load timeout, and the deadlines that follow. --averaging-timeout and the
    load timeout are floors; --link-mbit is a low-comm rate. (A bound sized for loopback cut GPT-2 small's first
    download, 1 GB over a 20 Mbit/s uplink, every 120 s, and it started over each time.)"""
    link_mbit = swarm.link_mbit if swarm.sync == "low-comm" else 0.0
    deadlines = RoundDeadlines(sizes.deadline_bytes, swarm.averaging_timeout_s, link_mbit)
    first = deadlines.current()
    download = round_deadline(elements * STATE_BYTES_PER_ELEMENT[swarm.sync], swarm.load_state_timeout_s, link_mbit)
    if swarm.sync == "low-comm":
        logger.info(f"low-comm: {swarm.inner_steps} inner updates per outer round, pseudo-gradient in "
                    f"{sizes.what}; all-reduce deadline {first.seconds:.0f}s from {first.why}; a state download "
                    f"may take {download.seconds:.0f}s, from {download.why}")
    return (dataclasses.replace(swarm, averaging_timeout_s=first.seconds, load_state_timeout_s=download.seconds),
            deadlines)


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
