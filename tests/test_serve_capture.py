"""The capture store on a real SQLite file: rows per choice, retention, rewards, and nothing written until the
first completion."""
from __future__ import annotations

import sqlite3

import pytest

from dtrain.node.serve.capture import CaptureError, CaptureStore, Record

pytestmark = pytest.mark.unit


def _record(cid: str, choice: int = 0, step: int = 3) -> Record:
    return Record(id=cid, choice=choice, created=1.0, endpoint="text_completion", model="m", expert=None, step=step,
                  prompt="Hi", prompt_ids=(17250,), completion=" there", completion_ids=(612,), finish_reason="stop",
                  params={"temperature": 0}, total_ms=2.5)


def test_nothing_is_written_before_the_first_record(tmp_path):
    store = CaptureStore(tmp_path / "sub" / "c.sqlite", max_rows=10)
    assert store.count() == 0 and store.get("x") == [] and not (tmp_path / "sub").exists()
    with pytest.raises(CaptureError, match="no completion"):
        store.feedback("x", 1.0)
    assert not (tmp_path / "sub").exists()


def test_records_round_trip_and_rewards_attach(tmp_path):
    store = CaptureStore(tmp_path / "c.sqlite", max_rows=10)
    store.record([_record("a", 0), _record("a", 1)])
    assert store.get("a") == [_record("a", 0), _record("a", 1)]
    assert store.feedback("a", -1.0, choice=1) == 1
    assert store.feedback("a", 0.25) == 2
    assert [r.reward for r in store.get("a")] == [0.25, 0.25]
    for bad in (1.01, float("nan"), float("inf"), "1"):
        with pytest.raises(CaptureError, match="reward"):
            store.feedback("a", bad)
    with pytest.raises(CaptureError, match="choice 2"):
        store.feedback("a", 0.5, choice=2)
    rewarded = store.untrained_rewarded(10)
    store.mark_trained([(seq,) for seq, _ in rewarded[:1]], step=9)
    assert [r.choice for _, r in store.untrained_rewarded(10)] == [1]
    store.close()
    with sqlite3.connect(tmp_path / "c.sqlite") as conn:  # another reader of the same file sees it all
        assert conn.execute("SELECT choice, reward, trained_step FROM completions ORDER BY choice").fetchall() == [
            (0, 0.25, 9), (1, 0.25, None)]


def test_retention_drops_the_oldest_rows(tmp_path):
    store = CaptureStore(tmp_path / "c.sqlite", max_rows=3)
    for i in range(5):
        store.record([_record(f"id{i}")])
    assert store.count() == 3 and store.get("id1") == [] and store.get("id2") and store.get("id4")
    with pytest.raises(CaptureError, match="retention"):
        store.feedback("id0", 1.0)
