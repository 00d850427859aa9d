"""Every served completion, recorded in an embedded SQLite database (stdlib sqlite3), and the rewards given to it.

One row per choice: `(id, choice)` is the completion id the client got and the choice's index. The row keeps what
training on it needs exactly (the prompt and completion token ids as the model saw and wrote them, the model step)
and what a person reading it wants (texts, parameters, timing). `POST /v1/feedback` sets `reward`; the feedback
trainer sets `trained_step` once a row went into a contribution. Retention: past `max_rows` rows the oldest are
deleted on insert. The file is created at the first record, so a node that serves nothing writes nothing; a node
records at all only when its operator names the file (`--capture-db`).

Who may reward a completion: the client that received it. Each completion is served with a random feedback token;
the row keeps only the token's SHA-256 (`feedback_hash`), and feedback must present the token. Knowing an id (from
a log, a shared transcript) is not enough to steer what the feedback trainer learns.

One connection, shared by the threads that record and read (serialized by a lock; SQLite's own locking keeps a
second process reading the file safe). WAL journal: readers do not block the writer.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS completions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- insertion order: retention drops the lowest
    id TEXT NOT NULL,                       -- the completion id the client got (cmpl-..., chatcmpl-...)
    choice INTEGER NOT NULL,                -- index of the choice within the completion
    created REAL NOT NULL,                  -- unix time the request arrived
    endpoint TEXT NOT NULL,                 -- completions or chat.completions
    model TEXT NOT NULL,                    -- the model name asked for (the shared model or a LoRA expert)
    expert TEXT,                            -- the LoRA expert that served it, NULL for the bare shared model
    step INTEGER NOT NULL,                  -- model step of the weights that wrote it
    prompt TEXT NOT NULL,                   -- the prompt text the model saw (chat: the rendered template)
    prompt_ids TEXT NOT NULL,               -- its token ids, JSON
    completion TEXT NOT NULL,               -- the text the client got
    completion_ids TEXT NOT NULL,           -- the generated token ids, JSON (end of text excluded)
    finish_reason TEXT NOT NULL,            -- stop or length
    params TEXT NOT NULL,                   -- the request's parameters (and chat messages), JSON
    queue_ms REAL,                          -- arrival to admission into the decode batch
    first_token_ms REAL,                    -- arrival to the first text
    total_ms REAL,                          -- arrival to the last token
    reward REAL,                            -- in [-1, 1], from POST /v1/feedback; NULL until given
    rewarded_at REAL,
    trained_step INTEGER,                   -- the step whose contribution used this row; NULL until then
    feedback_hash TEXT,                     -- SHA-256 (hex) of the feedback token the client got; NULL: no feedback
    UNIQUE (id, choice)
);
CREATE INDEX IF NOT EXISTS completions_untrained ON completions (trained_step, reward);
"""


class CaptureError(ValueError):
    """Feedback that cannot be attached: unknown id or choice."""


class FeedbackForbidden(CaptureError):
    """Feedback without the token its completion was served with."""


def token_hash(token: str) -> str:
    """What the store keeps of a feedback token: its SHA-256, hex (the token itself never touches the disk)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Record:
    """One choice of one served completion."""

    id: str
    choice: int
    created: float
    endpoint: str
    model: str
    expert: Optional[str]
    step: int
    prompt: str
    prompt_ids: tuple[int, ...]
    completion: str
    completion_ids: tuple[int, ...]
    finish_reason: str
    params: dict
    queue_ms: Optional[float] = None
    first_token_ms: Optional[float] = None
    total_ms: Optional[float] = None
    reward: Optional[float] = None
    trained_step: Optional[int] = None
    feedback_hash: Optional[str] = None


_COLUMNS = ("id", "choice", "created", "endpoint", "model", "expert", "step", "prompt", "prompt_ids", "completion",
            "completion_ids", "finish_reason", "params", "queue_ms", "first_token_ms", "total_ms", "feedback_hash")


class CaptureStore:
    def __init__(self, path: str | Path, max_rows: int):
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive integer, got {max_rows!r}")
        self.path = Path(path)
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._conn: Optional[sqlite3.Connection] = None

    def _db(self, create: bool) -> Optional[sqlite3.Connection]:
        if self._conn is None:
            if not create and not self.path.exists():
                return None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False, timeout=10.0)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(SCHEMA)
            columns = {row[1] for row in conn.execute("PRAGMA table_info(completions)")}
            if "feedback_hash" not in columns:  # a file written before tokens: its rows take no feedback
                conn.execute("ALTER TABLE completions ADD COLUMN feedback_hash TEXT")
            self._conn = conn
        return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # ---- writing

    def record(self, records: Sequence[Record]) -> None:
        """Insert the choices of one completion, then drop the oldest rows past `max_rows`."""
        rows = [(r.id, r.choice, r.created, r.endpoint, r.model, r.expert, r.step, r.prompt, json.dumps(r.prompt_ids),
                 r.completion, json.dumps(r.completion_ids), r.finish_reason, json.dumps(r.params, sort_keys=True),
                 r.queue_ms, r.first_token_ms, r.total_ms, r.feedback_hash) for r in records]
        with self._lock:
            db = self._db(create=True)
            with db:
                db.executemany(f"INSERT INTO completions ({', '.join(_COLUMNS)}) "
                               f"VALUES ({', '.join('?' * len(_COLUMNS))})", rows)
                db.execute("DELETE FROM completions WHERE seq <= (SELECT MAX(seq) FROM completions) - ?",
                           (self.max_rows,))

    def feedback(self, completion_id: str, reward: float, choice: Optional[int], token: str) -> int:
        """Attach `reward` to one choice (or every choice) of a completion whose feedback token is `token`; returns
        the rows changed. Nothing changes unless every addressed row was served with that token."""
        if not (isinstance(reward, (int, float)) and math.isfinite(reward) and -1.0 <= reward <= 1.0):
            raise CaptureError(f"reward must be a number in [-1, 1], got {reward!r}")
        if not isinstance(token, str) or not token:
            raise FeedbackForbidden("feedback needs the feedback token the completion was served with")
        what = f"choice {choice} of completion {completion_id!r}" if choice is not None else \
            f"completion {completion_id!r}"
        expected = token_hash(token)
        with self._lock:
            db = self._db(create=False)
            if db is None:
                raise CaptureError(f"no {what} is recorded (never served here, or dropped by retention)")
            with db:
                where, args = "id = ?", [completion_id]
                if choice is not None:
                    where, args = "id = ? AND choice = ?", [completion_id, choice]
                hashes = [row[0] for row in db.execute(f"SELECT feedback_hash FROM completions WHERE {where}", args)]
                if not hashes:
                    raise CaptureError(f"no {what} is recorded (never served here, or dropped by retention)")
                if not all(h is not None and hmac.compare_digest(h, expected) for h in hashes):
                    raise FeedbackForbidden(f"the feedback token does not match {what}")
                changed = db.execute(f"UPDATE completions SET reward = ?, rewarded_at = ? WHERE {where}",
                                     [float(reward), time.time(), *args]).rowcount
        return changed

    def mark_trained(self, keys: Sequence[tuple[int]], step: int) -> None:
        """Rows (by `seq`) that went into the contribution of `step`."""
        with self._lock:
            db = self._db(create=False)
            if db is None:
                return
            with db:
                db.executemany("UPDATE completions SET trained_step = ? WHERE seq = ?", [(step, s) for (s,) in keys])

    # ---- reading

    def count(self) -> int:
        with self._lock:
            db = self._db(create=False)
            return 0 if db is None else db.execute("SELECT COUNT(*) FROM completions").fetchone()[0]

    def get(self, completion_id: str) -> list[Record]:
        return [r for _, r in self._select("WHERE id = ? ORDER BY choice", (completion_id,))]

    def untrained_rewarded(self, limit: int) -> list[tuple[int, Record]]:
        """(seq, record) of rewarded rows no contribution used yet, oldest first."""
        return self._select("WHERE reward IS NOT NULL AND trained_step IS NULL ORDER BY seq LIMIT ?", (limit,))

    def _select(self, clause: str, args: tuple[Any, ...]) -> list[tuple[int, Record]]:
        with self._lock:
            db = self._db(create=False)
            if db is None:
                return []
            cursor = db.execute(f"SELECT seq, {', '.join(_COLUMNS)}, reward, trained_step FROM completions {clause}", args)
            rows = cursor.fetchall()
        out = []
        for row in rows:
            values = dict(zip(("seq", *_COLUMNS, "reward", "trained_step"), row))
            seq = values.pop("seq")
            values["prompt_ids"] = tuple(json.loads(values["prompt_ids"]))
            values["completion_ids"] = tuple(json.loads(values["completion_ids"]))
            values["params"] = json.loads(values["params"])
            out.append((seq, Record(**values)))
        return out
