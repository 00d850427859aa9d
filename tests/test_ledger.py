"""Contributor ledger: counts per node_id, credits from an aggregate, bounded memory, thread safety."""

import threading

import numpy as np
import pytest

from dtrain.node.train import robust
from dtrain.node.contribution import Contribution, Section
from dtrain.node.train.ledger import ContributorLedger, LedgerConfigError, RejectReason, ScoringConfig

pytestmark = pytest.mark.unit


class Clock:
    """A clock the test advances by hand: last-seen times become exact."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        self.now += 1.0
        return self.now


def test_counts_per_contributor():
    ledger = ContributorLedger(clock=Clock())
    ledger.accepted("a", 4)
    ledger.accepted("a", 6)
    ledger.rejected("a", RejectReason.RATE_LIMITED)
    ledger.rejected("a", "rate_limited")
    ledger.rejected("b", RejectReason.STEP_MISMATCH)
    a, b = ledger.get("a"), ledger.get("b")
    assert (a.accepted, a.samples_claimed, a.rejected) == (2, 10, {"rate_limited": 2})
    assert (a.first_seen_s, a.last_seen_s) == (1001.0, 1004.0)
    assert (b.accepted, b.rejected, b.samples_credited) == (0, {"step_mismatch": 1}, 0)
    assert ledger.get("nobody") is None
    assert [r.node_id for r in ledger.records()] == ["b", "a"]  # most recently seen first
    with pytest.raises(ValueError):
        ledger.rejected("a", "bored")


def test_credits_and_outliers_come_from_the_aggregate():
    elements = [50]
    rng = np.random.default_rng(0)
    honest = [Contribution(f"h{i}", 0, 4, 3.0, (Section(0, None, rng.normal(size=50).astype(np.float32)),))
              for i in range(4)]
    huge = Contribution("x", 0, 1000, 3.0, (Section(0, None, 1e6 * rng.normal(size=50).astype(np.float32)),))
    ledger = ContributorLedger()
    for c in honest + [huge]:
        ledger.accepted(c.contributor, c.samples)
    result = robust.aggregate(honest + [huge], elements, robust.RobustConfig(max_weight_multiple=2.0))
    ledger.record_aggregate(result)
    x, h0 = ledger.get("x"), ledger.get("h0")
    assert (x.samples_claimed, x.samples_credited, x.outliers) == (1000, 8, 1)
    assert (h0.samples_claimed, h0.samples_credited, h0.outliers) == (4, 4, 0)
    ledger.refused_update(["x", "x", "h0"])
    assert ledger.get("x").rejected == {"non_finite": 1}


def test_memory_is_bounded_and_the_least_recently_seen_go_first():
    ledger = ContributorLedger(max_contributors=3, clock=Clock())
    for name in ["a", "b", "c"]:
        ledger.accepted(name, 1)
    ledger.accepted("a", 1)  # a is now the most recent: b is the oldest
    for i in range(100):  # an attacker inventing ids
        ledger.rejected(f"sybil{i}", RejectReason.RATE_LIMITED)
    summary = ledger.summary()
    assert (summary.contributors, summary.evicted) == (3, 100)
    assert [r.node_id for r in ledger.records()] == ["sybil99", "sybil98", "sybil97"]
    assert len(ledger.records(limit=2)) == 2


def test_concurrent_updates_are_all_counted():
    ledger = ContributorLedger()

    def work(k):
        for i in range(500):
            ledger.accepted(f"n{i % 7}", 2)
            ledger.rejected(f"n{(i + k) % 7}", RejectReason.MALFORMED)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    records = ledger.records()
    assert sum(r.accepted for r in records) == 2000
    assert sum(r.samples_claimed for r in records) == 4000
    assert sum(r.rejected["malformed"] for r in records) == 2000


def test_records_are_snapshots():
    ledger = ContributorLedger()
    ledger.rejected("a", RejectReason.MALFORMED)
    snap = ledger.get("a")
    snap.rejected["malformed"] = 99
    assert ledger.get("a").rejected == {"malformed": 1}


# ---------------------------------------------------------------------------------------------------------
# scoring over time against the node's trusted reference


def judged(cosines: dict[str, float]) -> robust.Aggregate:
    """A hand-over whose packets were judged against a trusted reference with these cosines."""
    reports = tuple(robust.ContributorReport(contributor=who, samples=2, weight=2 if cos > 0 else 0, norm=1.0,
                                             clip_factor=1.0, center_factor=1.0, cosine=cos, outlier=cos <= 0,
                                             trusted=True)
                    for who, cos in cosines.items())
    return robust.Aggregate((), (8,), sum(r.weight for r in reports), 6.0, None, "centered_clip", reports)


def test_a_persistently_disagreeing_contributor_is_scored_out_and_an_honest_one_never():
    scoring = ScoringConfig(window=16, min_judged=8, min_agree_fraction=0.5, ramp_agreed=4)
    ledger = ContributorLedger(clock=Clock(), scoring=scoring)
    for i in range(7):  # honest: agrees 6 of 7 times; the flipper never
        ledger.record_aggregate(judged({"honest": 0.2 if i != 3 else -0.01, "flipper": -0.2}))
    assert ledger.refusal("flipper") is None and not ledger.get("flipper").scored_out  # 7 judged: not yet
    ledger.record_aggregate(judged({"honest": 0.3, "flipper": -0.3}))
    message = ledger.refusal("flipper")
    assert message is not None and "flipper" in message and "0 of its last 8" in message
    f, h = ledger.get("flipper"), ledger.get("honest")
    assert (f.agreed, f.disagreed, f.score, f.ramp, f.scored_out) == (0, 8, 0.0, 0.0, True)
    assert (h.agreed, h.disagreed, h.score, h.ramp, h.scored_out) == (7, 1, 7 / 8, 1.0, False)
    assert ledger.refusal("honest") is None and ledger.excluded(["honest", "flipper", "x"]) == {"flipper"}
    assert ledger.summary().scored_out == 1
    ledger.record_aggregate(judged({"flipper": 0.9}))  # scored out for good: nothing more is scored
    assert ledger.get("flipper").agreed == 0 and ledger.refusal("flipper") is not None


def test_a_new_contributor_ramps_up_with_agreeing_contributions():
    ledger = ContributorLedger(clock=Clock(), scoring=ScoringConfig(ramp_agreed=4))
    assert ledger.ramps(["new"]) == {"new": 0.0}
    for expected in (0.25, 0.5, 0.75, 1.0, 1.0):
        ledger.record_aggregate(judged({"new": 0.1}))
        assert ledger.ramps(["new"]) == {"new": expected}
    ledger.record_aggregate(judged({"new": -0.1}))  # a disagreeing one earns nothing
    assert ledger.get("new").ramp == 1.0 and ledger.get("new").disagreed == 1


def test_scoring_off_judges_nobody_and_gives_everyone_the_full_multiple():
    ledger = ContributorLedger(clock=Clock(), scoring=ScoringConfig(enabled=False))
    for _ in range(40):
        ledger.record_aggregate(judged({"flipper": -0.5}))
    assert ledger.refusal("flipper") is None and ledger.ramps(["flipper", "new"]) == {"flipper": 1.0, "new": 1.0}
    with pytest.raises(LedgerConfigError):
        ScoringConfig(window=4, min_judged=8)
