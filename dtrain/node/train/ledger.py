"""Who contributed what: a per-`node_id` ledger of packets and samples, and a score over time.

`node_id`s are chosen by whoever sends a packet, so the ledger keeps at most `max_contributors` of them and
forgets the least recently seen first: memory stays bounded whatever ids arrive. Records come out as frozen
dataclasses; the bridge turns them into JSON (the node builds none).

Scoring (`ScoringConfig`): every contribution judged against the node's trusted reference (train/reference.py)
either agreed with it (positive cosine) or not. Over a contributor's last `window` judged contributions:
- at least `min_judged` of them, and fewer than `min_agree_fraction` agreeing: the contributor is scored out, for
  good (until the ledger forgets it): its packets are refused with 403 naming why, and its contributions already
  gathered count 0. Honest top-1% packets of the bench agree with the reference most of the time, sign-flipped
  ones almost never (docs/robustness.md gives the numbers behind the defaults);
- its `ramp`, agreeing contributions / `ramp_agreed` (at most 1), is how much of the weight multiple its record has
  earned (robust.aggregate): a new `node_id` counts at most as much as a typical contributor, so many new ids claiming
  large `samples` (Sybils arriving in numbers) weigh no more than as many typical browsers.
A forgotten (evicted) contributor starts again with no record: a new id has no more weight than a typical one.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
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
    SCORED_OUT = "scored_out"  # (403) its record disagreed with the node's reference persistently


class LedgerConfigError(ValueError):
    """A scoring option out of range; the message names it."""


@dataclass(frozen=True)
class ScoringConfig:
    """When a contributor's record refuses it, and how fast a new one earns its weight (module docstring)."""

    enabled: bool = True
    window: int = 32  # judged contributions the score is taken over (the most recent)
    min_judged: int = 8  # judged contributions before anyone is scored out
    min_agree_fraction: float = 0.5  # scored out below this fraction agreeing, over the window
    ramp_agreed: int = 8  # agreeing contributions that earn the full weight multiple

    def __post_init__(self):
        if not 1 <= self.min_judged <= self.window:
            raise LedgerConfigError(f"need 1 <= min_judged <= window, got {self.min_judged} and {self.window}")
        if not 0 <= self.min_agree_fraction <= 1:
            raise LedgerConfigError(f"min_agree_fraction must be in [0, 1], got {self.min_agree_fraction}")
        if self.ramp_agreed < 0:
            raise LedgerConfigError(f"ramp_agreed must be >= 0, got {self.ramp_agreed}")


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
    agreed: int = 0  # contributions judged against the node's reference that agreed with it (positive cosine)
    disagreed: int = 0  # judged ones that did not (counted 0)
    score: Optional[float] = None  # fraction agreeing over the recent window; None: none judged yet
    ramp: float = 0.0  # share of the weight multiple its record earned (0: new, 1: full)
    scored_out: bool = False  # refused with 403 from now on


@dataclass(frozen=True)
class LedgerSummary:
    contributors: int  # records kept now
    evicted: int  # records forgotten to stay within max_contributors, since start
    max_contributors: int
    scored_out: int = 0  # of the records kept, contributors refused for their record


@dataclass
class _Entry:
    first_seen_s: float
    last_seen_s: float
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    outliers: int = 0
    samples_claimed: int = 0
    samples_credited: int = 0
    agreed: int = 0
    disagreed: int = 0
    recent: deque = field(default_factory=deque)  # bools, the last ScoringConfig.window judgements
    scored_out: bool = False


class ContributorLedger:
    """Thread-safe counts per node_id, at most `max_contributors` of them (least recently seen go first)."""

    def __init__(self, max_contributors: int = DEFAULT_MAX_CONTRIBUTORS, clock: Callable[[], float] = time.time,
                 scoring: ScoringConfig = ScoringConfig()):
        if max_contributors < 1:
            raise ValueError(f"max_contributors must be >= 1, got {max_contributors}")
        self.max_contributors = max_contributors
        self.scoring = scoring
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
        """Credit the samples each packet of one hand-over was counted with, count its outliers, and score the
        contributions judged against the node's trusted reference."""
        cfg = self.scoring
        with self._lock:
            for report in result.reports:
                entry = self._touch(report.contributor)
                entry.samples_credited += report.weight
                entry.outliers += int(report.outlier)
                if not (cfg.enabled and report.trusted and report.cosine is not None) or entry.scored_out:
                    continue
                agreed = report.cosine > 0
                entry.agreed += int(agreed)
                entry.disagreed += int(not agreed)
                entry.recent.append(agreed)
                while len(entry.recent) > cfg.window:
                    entry.recent.popleft()
                if len(entry.recent) >= cfg.min_judged and _score(entry) < cfg.min_agree_fraction:
                    entry.scored_out = True
                    logger.warning(f"contributor {report.contributor!r} scored out: {sum(entry.recent)} of its last "
                                   f"{len(entry.recent)} contributions agreed with the node's reference; refused "
                                   f"from now on")

    def refusal(self, node_id: str) -> Optional[str]:
        """Why packets of node_id are refused (403), or None when they are not."""
        with self._lock:
            entry = self._entries.get(node_id)
            if entry is None or not entry.scored_out:
                return None
            return (f"contributor {node_id!r} is refused: {sum(entry.recent)} of its last {len(entry.recent)} "
                    f"contributions agreed with this node's own gradient (at least "
                    f"{self.scoring.min_agree_fraction:.0%} must)")

    def ramps(self, node_ids: Iterable[str]) -> dict[str, float]:
        """Per node_id, the share of the weight multiple its record earned (robust.aggregate's `ramps`)."""
        with self._lock:
            return {n: self._ramp(self._entries.get(n)) for n in set(node_ids)}

    def excluded(self, node_ids: Iterable[str]) -> frozenset:
        """Those of node_ids that are scored out."""
        with self._lock:
            return frozenset(n for n in set(node_ids) if (e := self._entries.get(n)) is not None and e.scored_out)

    def _ramp(self, entry: Optional[_Entry]) -> float:
        if not self.scoring.enabled or self.scoring.ramp_agreed == 0:
            return 1.0
        if entry is None:
            return 0.0
        return min(1.0, entry.agreed / self.scoring.ramp_agreed)

    def refused_update(self, node_ids: Iterable[str]) -> None:
        """An update was refused as non-finite; these contributors' packets were in it."""
        for node_id in set(node_ids):
            self.rejected(node_id, RejectReason.NON_FINITE)

    def get(self, node_id: str) -> Optional[ContributorRecord]:
        with self._lock:
            entry = self._entries.get(node_id)
            return None if entry is None else self._record(node_id, entry)

    def records(self, limit: Optional[int] = None) -> tuple[ContributorRecord, ...]:
        """Most recently seen first; at most `limit` of them."""
        with self._lock:
            items = list(reversed(self._entries.items()))
            if limit is not None:
                items = items[:max(limit, 0)]
            return tuple(self._record(k, e) for k, e in items)

    def summary(self) -> LedgerSummary:
        with self._lock:
            return LedgerSummary(len(self._entries), self._evicted, self.max_contributors,
                                 sum(e.scored_out for e in self._entries.values()))

    def _record(self, node_id: str, e: _Entry) -> ContributorRecord:
        return ContributorRecord(node_id=node_id, accepted=e.accepted, rejected=dict(e.rejected), outliers=e.outliers,
                                 samples_claimed=e.samples_claimed, samples_credited=e.samples_credited,
                                 first_seen_s=e.first_seen_s, last_seen_s=e.last_seen_s, agreed=e.agreed,
                                 disagreed=e.disagreed, score=_score(e) if e.recent else None,
                                 ramp=self._ramp(e), scored_out=e.scored_out)


def _score(e: _Entry) -> float:
    return sum(e.recent) / len(e.recent)
