"""Round deadlines that fit the link: derived from the bytes a round moves and the throughput it can count on.

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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
