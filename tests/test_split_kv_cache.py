"""Session-keyed KV caches: bounded by count (LRU) and idle time (TTL), one lock per session, bad arguments typed
errors."""
import threading
import time

import pytest
from transformers import DynamicCache

from dtrain.node.split.kv_cache import KVCacheStore, SessionCache, SessionIdError, SplitError

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(seq_len: int = 1, step: int = 0) -> SessionCache:
    return SessionCache(DynamicCache(), step, seq_len)


def test_put_get_drop_len():
    store = KVCacheStore(max_sessions=4)
    assert len(store) == 0 and store.get("a") is None
    e = entry(seq_len=7, step=3)
    store.put("a", e)
    assert len(store) == 1 and "a" in store
    got = store.get("a")
    assert got is e and got.seq_len == 7 and got.step == 3
    assert store.drop("a") is True
    assert store.drop("a") is False
    assert len(store) == 0 and store.get("a") is None


def test_lru_eviction_order():
    store = KVCacheStore(max_sessions=3)
    for sid in ("a", "b", "c"):
        store.put(sid, entry())
    assert store.get("a") is not None  # a becomes most recently used: order b, c, a
    store.put("d", entry())  # evicts b
    assert store.session_ids() == ["c", "a", "d"]
    store.put("c", entry(seq_len=2))  # re-put refreshes c: order a, d, c
    store.put("e", entry())  # evicts a
    assert store.session_ids() == ["d", "c", "e"]
    assert store.get("a") is None and store.get("b") is None
    assert store.get("c").seq_len == 2


def test_ttl_expiry_with_injected_clock():
    clock = FakeClock()
    store = KVCacheStore(max_sessions=8, ttl_s=10.0, clock=clock)
    store.put("old", entry())
    clock.now += 6
    store.put("new", entry())
    clock.now += 3  # old idle 9 s, new 3 s
    assert store.get("old") is not None  # touching it resets its idle time
    clock.now += 8  # old idle 8 s, new 11 s
    assert store.get("new") is None
    assert store.session_ids() == ["old"]
    clock.now += 10
    assert len(store) == 0


def test_bad_arguments_raise_typed_errors():
    store = KVCacheStore()
    for bad in ("", None, 5, "x" * 129):
        with pytest.raises(SessionIdError):
            store.get(bad)
    assert issubclass(SessionIdError, SplitError) and issubclass(SplitError, ValueError)
    with pytest.raises(ValueError, match="max_sessions"):
        KVCacheStore(max_sessions=0)
    with pytest.raises(ValueError, match="ttl_s"):
        KVCacheStore(ttl_s=0)
    with pytest.raises(TypeError):
        store.put("a", (DynamicCache(), 0, 1))


def test_session_lock_is_shared_per_session_and_distinct_across():
    store = KVCacheStore()
    lock_a = store.session("a")
    assert store.session("a") is lock_a
    assert store.session("b") is not lock_a


@pytest.mark.timeout(20)
def test_same_session_serializes_different_sessions_overlap():
    store = KVCacheStore()
    state = {"active": {"a": 0, "b": 0}, "max_same": 0, "overlap": False}
    guard = threading.Lock()
    both_inside = threading.Barrier(2, timeout=5)  # one request of a and one of b must be inside together

    def request(sid: str, wait_for_other: bool):
        with store.session(sid):
            with guard:
                state["active"][sid] += 1
                state["max_same"] = max(state["max_same"], state["active"][sid])
            if wait_for_other:
                both_inside.wait()  # would time out (BrokenBarrierError) if sessions serialized each other
                with guard:  # either waiter may see it: the other may have left already when a loaded machine wakes it
                    state["overlap"] |= state["active"]["a"] >= 1 and state["active"]["b"] >= 1
            time.sleep(0.02)  # give another request of the same session the chance to interleave
            entry_ = store.get(sid)
            store.put(sid, entry(seq_len=(entry_.seq_len + 1) if entry_ else 1))
            with guard:
                state["active"][sid] -= 1

    threads = [threading.Thread(target=request, args=("a", True)), threading.Thread(target=request, args=("b", True))]
    threads += [threading.Thread(target=request, args=(sid, False)) for sid in ("a", "b") * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["overlap"] is True
    assert state["max_same"] == 1  # never two requests of one session inside at once
    assert store.get("a").seq_len == 5 and store.get("b").seq_len == 5  # no lost read-modify-write
