"""The capture store on a real SQLite file: rows per choice, retention, rewards only with the completion's feedback
token, and nothing written until the first completion."""
from __future__ import annotations

import sqlite3

import pytest

from dtrain.node.serve.capture import CaptureError, CaptureStore, FeedbackForbidden, Record, token_hash

pytestmark = pytest.mark.unit


TOKEN = "token-of-the-client"


def _record(cid: str, choice: int = 0, step: int = 3, token: str = TOKEN) -> Record:
    return Record(id=cid, choice=choice, created=1.0, endpoint="text_completion", model="m", expert=None, step=step,
                  prompt="Hi", prompt_ids=(17250,), completion=" there", completion_ids=(612,), finish_reason="stop",
                  params={"temperature": 0}, total_ms=2.5, feedback_hash=token_hash(token))


def test_nothing_is_written_before_the_first_record(tmp_path):
    store = CaptureStore(tmp_path / "sub" / "c.sqlite", max_rows=10)
    assert store.count() == 0 and store.get("x") == [] and not (tmp_path / "sub").exists()
    with pytest.raises(CaptureError, match="no completion"):
        store.feedback("x", 1.0, None, TOKEN)
    assert not (tmp_path / "sub").exists()


def test_records_round_trip_and_rewards_attach(tmp_path):
    store = CaptureStore(tmp_path / "c.sqlite", max_rows=10)
    store.record([_record("a", 0), _record("a", 1)])
    assert store.get("a") == [_record("a", 0), _record("a", 1)]
    assert store.feedback("a", -1.0, 1, TOKEN) == 1
    assert store.feedback("a", 0.25, None, TOKEN) == 2
    assert [r.reward for r in store.get("a")] == [0.25, 0.25]
    for bad in (1.01, float("nan"), float("inf"), "1"):
        with pytest.raises(CaptureError, match="reward"):
            store.feedback("a", bad, None, TOKEN)
    with pytest.raises(CaptureError, match="choice 2"):
        store.feedback("a", 0.5, 2, TOKEN)
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
        store.feedback("id0", 1.0, None, TOKEN)


def test_only_the_token_a_completion_was_served_with_rewards_it(tmp_path):
    store = CaptureStore(tmp_path / "c.sqlite", max_rows=10)
    store.record([_record("a", 0), _record("a", 1)])
    store.record([_record("b", 0, token="another client's")])
    for token in ("", "token-of-the-clien", "another client's", None):
        with pytest.raises(FeedbackForbidden):
            store.feedback("a", 1.0, None, token)
    with pytest.raises(FeedbackForbidden):
        store.feedback("b", 1.0, 0, TOKEN)
    assert [r.reward for r in store.get("a") + store.get("b")] == [None, None, None]  # nothing half-applied
    assert store.feedback("b", -0.5, 0, "another client's") == 1
    store.close()
    with sqlite3.connect(tmp_path / "c.sqlite") as conn:  # the file keeps the token's hash, never the token
        stored = [h for (h,) in conn.execute("SELECT feedback_hash FROM completions ORDER BY seq")]
        assert stored == [token_hash(TOKEN)] * 2 + [token_hash("another client's")]
        assert not conn.execute("SELECT COUNT(*) FROM completions WHERE feedback_hash = ?", (TOKEN,)).fetchone()[0]


def test_a_file_from_before_tokens_gains_the_column_and_its_rows_take_no_feedback(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as conn:  # the table as it was before feedback tokens
        conn.executescript("""CREATE TABLE completions (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL,
            choice INTEGER NOT NULL, created REAL NOT NULL, endpoint TEXT NOT NULL, model TEXT NOT NULL, expert TEXT,
            step INTEGER NOT NULL, prompt TEXT NOT NULL, prompt_ids TEXT NOT NULL, completion TEXT NOT NULL,
            completion_ids TEXT NOT NULL, finish_reason TEXT NOT NULL, params TEXT NOT NULL, queue_ms REAL,
            first_token_ms REAL, total_ms REAL, reward REAL, rewarded_at REAL, trained_step INTEGER,
            UNIQUE (id, choice));
            INSERT INTO completions (id, choice, created, endpoint, model, step, prompt, prompt_ids, completion,
            completion_ids, finish_reason, params) VALUES ('old', 0, 1.0, 'completions', 'm', 1, 'p', '[1]', 'c',
            '[2]', 'stop', '{}');""")
    store = CaptureStore(path, max_rows=10)
    assert store.count() == 1 and store.get("old")[0].feedback_hash is None
    with pytest.raises(FeedbackForbidden):
        store.feedback("old", 1.0, None, TOKEN)
    store.record([_record("new")])
    assert store.feedback("new", 1.0, None, TOKEN) == 1
