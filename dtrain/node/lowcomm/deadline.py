"""Round deadlines that fit the link: derived from the bytes a round moves and the throughput it can count on.

A window sized for loopback aborts every round of a large model over a home uplink (GPT-2 small's full gradient is
about 250 MB in fp16: more than 100 s at 20 Mbit/s). The deadline of one all-reduce is the time its bytes take at
the slower of the configured link rate and the measured throughput of earlier rounds, times a margin, and never
below the configured floor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MARGIN = 3.0  # a round may take this many times its bytes' transfer time: TCP ramp-up, uneven peers, a busy host
SMOOTHING = 0.5  # weight of the newest throughput measurement in the running estimate


@dataclass(frozen=True)
class Deadline:
    seconds: float
    why: str  # how it was derived, for the log line of a round that is aborted


def round_deadline(bytes_each_way: float, floor_s: float, link_mbit: float = 0.0,
                   measured_bps: Optional[float] = None) -> Deadline:
    """Seconds one all-reduce may take. `link_mbit` 0: no configured rate; `measured_bps`: bytes/s seen so far."""
    rates = []
    if link_mbit > 0:
        rates.append((link_mbit * 1e6 / 8, f"the link's {link_mbit:g} Mbit/s"))
    if measured_bps:
        rates.append((measured_bps, f"a measured {measured_bps * 8 / 1e6:.1f} Mbit/s"))
    if not rates or bytes_each_way <= 0:
        return Deadline(floor_s, f"the configured {floor_s:g}s (no rate known)")
    rate, source = min(rates)
    need = MARGIN * bytes_each_way / rate
    if need <= floor_s:
        return Deadline(floor_s, f"the configured {floor_s:g}s ({bytes_each_way / 1e6:.1f} MB at {source} "
                                 f"needs {need:.1f}s with margin)")
    return Deadline(need, f"{bytes_each_way / 1e6:.1f} MB at {source}, x{MARGIN:g}")


class Throughput:
    """Running estimate of the bytes per second a completed round moved (none before the first)."""

    def __init__(self):
        self.bps: Optional[float] = None

    def observe(self, bytes_moved: float, seconds: float) -> None:
        if bytes_moved <= 0 or not seconds > 0:
            return
        sample = bytes_moved / seconds
        self.bps = sample if self.bps is None else SMOOTHING * sample + (1 - SMOOTHING) * self.bps
