"""Who contributed what: a per-`node_id` ledger of packets and samples.

`node_id`s are chosen by whoever sends a packet, so the ledger keeps at most `max_contributors` of them and
forgets the least recently seen first: memory stays bounded whatever ids arrive. Records come out as frozen
dataclasses; the bridge turns them into JSON (the node builds none).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Optional

from hivemind.utils.logging import get_logger

from dtrain.node.train.robust import Aggregate

logger = get_logger(__name__)

DEFAULT_MAX_CONTRIBUTORS = 10_000  # about 2 MB of records at most


class RejectReason(str, Enum):
    """Why a packet that named a `node_id` changed nothing (its HTTP answer in brackets)."""

    MALFORMED = "malformed"  # (400) its header decoded, the rest did not
    SAMPLES_CAP = "samples_cap"  # (400) samples above max_samples_per_packet
    STEP_MISMATCH = "step_mismatch"  # (409) outside the late window
    RATE_LIMITED = "rate_limited"  # (429) over its token bucket
    NODE_BUSY = "node_busy"  # (503) the node held --max-pending-mib of packets not yet taken for training
    NON_FINITE = "non_finite"  # (200 earlier) the update it went into would have been non-finite and was refused


@dataclass(frozen=True)
class ContributorRecord:
    """One contributor's counts; a snapshot, safe to keep and serialise."""

    node_id: str
    accepted: int  # packets answered 200
    rejected: dict[str, int]  # packets refused, by RejectReason value
    outliers: int  # accepted packets the robust aggregation clipped, pulled in or down-weighted
    samples_claimed: int  # samples the accepted packets claimed
    samples_credited: int  # samples they were counted with in updates (after the weight bound)
    first_seen_s: float  # wall-clock time (time.time()) of its first packet the ledger remembers
    last_seen_s: float  # wall-clock time of its latest packet or credit


@dataclass(frozen=True)
class LedgerSummary:
    contributors: int  # records kept now
    evicted: int  # records forgotten to stay within max_contributors, since start
    max_contributors: int


@dataclass
class _Entry:
    first_seen_s: float
    last_seen_s: float
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    outliers: int = 0
    samples_claimed: int = 0
    samples_credited: int = 0


class ContributorLedger:
    """Thread-safe counts per node_id, at most `max_contributors` of them (least recently seen go first)."""

    def __init__(self, max_contributors: int = DEFAULT_MAX_CONTRIBUTORS, clock: Callable[[], float] = time.time):
        if max_contributors < 1:
            raise ValueError(f"max_contributors must be >= 1, got {max_contributors}")
        self.max_contributors = max_contributors
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._evicted = 0
        self._lock = threading.Lock()

    def _touch(self, node_id: str) -> _Entry:
        """The entry of node_id, now the most recently seen; caller holds the lock."""
        now = self._clock()
        entry = self._entries.get(node_id)
        if entry is None:
            entry = self._entries[node_id] = _Entry(now, now)
            while len(self._entries) > self.max_contributors:
                self._entries.popitem(last=False)
                self._evicted += 1
        else:
            entry.last_seen_s = now
            self._entries.move_to_end(node_id)
        return entry

    def accepted(self, node_id: str, samples: int) -> None:
        """A packet answered 200, claiming `samples`."""
        with self._lock:
            entry = self._touch(node_id)
            entry.accepted += 1
            entry.samples_claimed += int(samples)

    def rejected(self, node_id: str, reason: RejectReason) -> None:
        reason = RejectReason(reason)
        with self._lock:
            entry = self._touch(node_id)
            entry.rejected[reason.value] = entry.rejected.get(reason.value, 0) + 1

    def record_aggregate(self, result: Aggregate) -> None:
        """Credit the samples each packet of one hand-over was counted with, and count its outliers."""
        with self._lock:
            for report in result.reports:
                entry = self._touch(report.contributor)
                entry.samples_credited += report.weight
                entry.outliers += int(report.outlier)

    def refused_update(self, node_ids: Iterable[str]) -> None:
        """An update was refused as non-finite; these contributors' packets were in it."""
        for node_id in set(node_ids):
            self.rejected(node_id, RejectReason.NON_FINITE)

    def get(self, node_id: str) -> Optional[ContributorRecord]:
        with self._lock:
            entry = self._entries.get(node_id)
            return None if entry is None else _record(node_id, entry)

    def records(self, limit: Optional[int] = None) -> tuple[ContributorRecord, ...]:
        """Most recently seen first; at most `limit` of them."""
        with self._lock:
            items = list(reversed(self._entries.items()))
            if limit is not None:
                items = items[:max(limit, 0)]
            return tuple(_record(k, e) for k, e in items)

    def summary(self) -> LedgerSummary:
        with self._lock:
            return LedgerSummary(len(self._entries), self._evicted, self.max_contributors)


def _record(node_id: str, e: _Entry) -> ContributorRecord:
    return ContributorRecord(node_id=node_id, accepted=e.accepted, rejected=dict(e.rejected), outliers=e.outliers,
                             samples_claimed=e.samples_claimed, samples_credited=e.samples_credited,
                             first_seen_s=e.first_seen_s, last_seen_s=e.last_seen_s)
