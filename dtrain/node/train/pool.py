"""Contributions accepted since the last hand-over: the only node state the bridge's threads write.

Training API v1 hands a node's bridge gradient to the swarm once `min_nodes_for_update` distinct
contributors have submitted. The pool checks each contribution's step against the late window, adds
`samples * gradient` to the group being gathered, and when the group is complete queues it as one hand-over
for the training thread to `take`. Nothing accepted leaves the pool except through `take`. With `max_bytes`, what
it holds is bounded: over it a contribution is refused with `PoolFull` (see `_refuses`).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from dtrain.node.contribution import Contribution

LATE_WINDOW_STEPS = 5  # packets for [step - 5, step] are accepted (Training API v1, "Late Submissions")


class StepMismatch(Exception):
    """A contribution's step is outside the accepted window; the client must fetch the latest model."""

    def __init__(self, server_step: int):
        super().__init__(f"step mismatch; fetch latest model (server step {server_step})")
        self.server_step = server_step


class PoolFull(Exception):
    """The pool holds its byte bound of contributions not yet taken; nothing applied, the client may retry."""

    def __init__(self, held_bytes: int, max_bytes: int):
        super().__init__(f"the node holds {held_bytes} bytes of accepted gradient not yet applied "
                         f"(bound {max_bytes} bytes); retry shortly")
        self.held_bytes, self.max_bytes = held_bytes, max_bytes


@dataclass
class HandOver:
    """One complete group of contributions: what the training thread adds to its pending gradient."""

    contributions: list[Contribution] = field(default_factory=list)
    contributors: set[str] = field(default_factory=set)

    @property
    def samples(self) -> int:
        return sum(c.samples for c in self.contributions)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.contributions)


@dataclass(frozen=True)
class PoolCounters:
    accepted_packets: int  # every contribution answered 200
    accepted_samples: int
    contributors: int  # distinct contributors ever accepted
    pending_contributors: int  # in the group being gathered (not yet handed over)


class ContributionPool:
    """Thread-safe: the bridge's worker threads `add`, the training thread `take`s."""

    def __init__(self, min_contributors: int, current_step: Callable[[], int], max_bytes: Optional[int] = None):
        self._min_contributors = min_contributors
        self._current_step = current_step
        self._max_bytes = max_bytes  # None: no bound
        self._bytes = 0  # held by contributions added and not yet taken (Contribution.nbytes)
        self._lock = threading.Lock()
        self._group = HandOver()  # the group being gathered
        self._ready: deque[HandOver] = deque()  # complete groups not yet taken, oldest first
        self._accepted_packets = 0
        self._accepted_samples = 0
        self._seen: set[str] = set()
        self._on_ready: list[Callable[[], None]] = []

    def on_ready(self, callback: Callable[[], None]) -> None:
        """Called (outside the lock) whenever a group is handed over: wakes the training thread."""
        self._on_ready.append(callback)

    def add(self, contribution: Contribution) -> int:
        """Accept one validated contribution; returns the server step.

        Raises StepMismatch or PoolFull; either way nothing was applied.
        """
        with self._lock:
            step = self._current_step()
            if not step - LATE_WINDOW_STEPS <= contribution.step <= step:
                raise StepMismatch(step)
            group = self._group
            if self._refuses(contribution, group):
                raise PoolFull(self._bytes, self._max_bytes)
            self._bytes += contribution.nbytes
            group.contributions.append(contribution)
            group.contributors.add(contribution.contributor)
            self._accepted_packets += 1
            self._accepted_samples += contribution.samples
            self._seen.add(contribution.contributor)
            complete = len(group.contributors) >= self._min_contributors
            if complete:
                self._ready.append(group)
                self._group = HandOver()
        if complete:
            for callback in self._on_ready:
                callback()
        return step

    def _refuses(self, contribution: Contribution, group: HandOver) -> bool:
        """Over the byte bound, refuse; but an empty pool takes any contribution (one larger than the bound would
        never get in otherwise), and while no group is ready, so that all the bytes wait for the group being
        gathered, a contributor new to that group is taken: only distinct contributors complete it, and only a
        complete group leaves the pool. Held bytes stay below max_bytes + min_contributors packets."""
        if self._max_bytes is None or self._bytes == 0 or self._bytes + contribution.nbytes <= self._max_bytes:
            return False
        return bool(self._ready) or contribution.contributor in group.contributors

    def take(self) -> Optional[HandOver]:
        """The oldest complete group not yet taken; None when there is none."""
        with self._lock:
            if not self._ready:
                return None
            hand_over = self._ready.popleft()
            self._bytes -= hand_over.nbytes
            return hand_over

    def counters(self) -> PoolCounters:
        with self._lock:
            return PoolCounters(self._accepted_packets, self._accepted_samples, len(self._seen),
                                len(self._group.contributors))
