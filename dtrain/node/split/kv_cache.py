"""Session-keyed KV caches for incremental split inference.

Each session holds the `DynamicCache` of the positions it has sent so far, the model step that built
it and how many positions it covers. The store is an LRU with a TTL; a per-session lock keeps two
requests of one session from interleaving while different sessions run side by side.

`SplitError` lives here because the session store is the bottom of the split package: every other
split module (and the engine, which re-exports it) raises subclasses of it.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from typing import Callable, NamedTuple, Optional

from transformers import DynamicCache
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

MAX_SESSION_ID_CHARS = 128


class SplitError(ValueError):
    """A split-inference request cannot be served; the message tells the client what to change."""


class SessionIdError(SplitError):
    """A session id is empty, too long or not a string."""


class SessionCache(NamedTuple):
    cache: DynamicCache  # keys/values of every position the session has sent
    step: int  # model step of the weights that computed `cache`
    seq_len: int  # positions held in `cache`


def check_session_id(session_id: object) -> str:
    if not isinstance(session_id, str) or not session_id:
        raise SessionIdError(f"session_id must be a non-empty string, got {session_id!r}")
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise SessionIdError(f"session_id is {len(session_id)} characters; at most {MAX_SESSION_ID_CHARS} allowed")
    return session_id


class KVCacheStore:
    """Thread-safe LRU of `SessionCache`s with a time-to-live per session.

    Use `with store.session(sid): entry = store.get(sid); ...; store.put(sid, new_entry)` so a session's
    read-modify-write is atomic with respect to other requests of the same session.
    """

    def __init__(self, max_sessions: int = 32, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        if not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive integer, got {max_sessions!r}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
        self._max_sessions = max_sessions
        self._ttl_s = float(ttl_s)
        self._clock = clock
        self._lock = threading.Lock()  # guards _entries and _session_locks; never held while computing
        self._entries: OrderedDict[str, tuple[SessionCache, float]] = OrderedDict()  # id -> (entry, last use); LRU first
        # A session's lock lives as long as someone holds a reference to it (a request in flight) or the
        # session is stored, so the table does not grow with every session id ever seen.
        self._session_locks: weakref.WeakValueDictionary[str, threading.Lock] = weakref.WeakValueDictionary()
        self._stored_locks: dict[str, threading.Lock] = {}

    @property
    def max_sessions(self) -> int:
        return self._max_sessions

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def session(self, session_id: str) -> threading.Lock:
        """The lock that serializes requests of `session_id` (the same object while any holder exists)."""
        check_session_id(session_id)
        with self._lock:
            lock = self._session_locks.get(session_id)
            if lock is None:
                lock = threading.Lock()
                self._session_locks[session_id] = lock
            return lock

    def get(self, session_id: str) -> Optional[SessionCache]:
        """The session's entry (marking it most recently used), or None if absent or expired."""
        check_session_id(session_id)
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            item = self._entries.get(session_id)
            if item is None:
                return None
            self._entries[session_id] = (item[0], now)
            self._entries.move_to_end(session_id)
            return item[0]

    def put(self, session_id: str, entry: SessionCache) -> None:
        """Store `entry` as the session's most recent state, evicting the least recently used beyond the cap."""
        check_session_id(session_id)
        if not isinstance(entry, SessionCache):
            raise TypeError(f"expected a SessionCache, got {type(entry).__name__}")
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            self._entries[session_id] = (entry, now)
            self._entries.move_to_end(session_id)
            self._stored_locks[session_id] = self._session_locks.setdefault(session_id, threading.Lock())
            while len(self._entries) > self._max_sessions:
                evicted, _ = self._entries.popitem(last=False)
                self._stored_locks.pop(evicted, None)
                logger.debug("evicted split session %r (LRU, cap %d)", evicted, self._max_sessions)

    def drop(self, session_id: str) -> bool:
        """Forget the session; True if it was stored."""
        check_session_id(session_id)
        with self._lock:
            self._stored_locks.pop(session_id, None)
            return self._entries.pop(session_id, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._stored_locks.clear()

    def session_ids(self) -> list[str]:
        """Live session ids, least recently used first."""
        with self._lock:
            self._expire_locked(self._clock())
            return list(self._entries)

    def __len__(self) -> int:
        with self._lock:
            self._expire_locked(self._clock())
            return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            self._expire_locked(self._clock())
            return session_id in self._entries

    def _expire_locked(self, now: float) -> None:
        # entries are in last-use order, so the expired ones are a prefix
        while self._entries:
            session_id, (_, last_use) = next(iter(self._entries.items()))
            if now - last_use < self._ttl_s:
                break
            del self._entries[session_id]
            self._stored_locks.pop(session_id, None)
            logger.debug("expired split session %r (idle >= %.0f s)", session_id, self._ttl_s)
