"""ContributionPool: the step window, groups of min_nodes_for_update distinct contributors, nothing lost between
threads."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from dtrain.node.contribution import Contribution, Section
from dtrain.node.train.pool import LATE_WINDOW_STEPS, ContributionPool, StepMismatch

pytestmark = pytest.mark.unit


def _contribution(contributor: str, step: int = 10, samples: int = 2, value: float = 1.0) -> Contribution:
    section = Section(0, np.array([1, 3], np.int64), np.array([value, -value], np.float32), unique=True)
    return Contribution(contributor, step, samples, loss=2.5, sections=(section,))


def test_groups_of_distinct_contributors():
    step = [10]
    pool = ContributionPool(min_contributors=2, current_step=lambda: step[0])
    assert pool.add(_contribution("a")) == 10
    pool.add(_contribution("a"))  # the same contributor twice is still one
    assert pool.take() is None and pool.counters().pending_contributors == 1
    pool.add(_contribution("b"))
    hand_over = pool.take()
    assert [c.contributor for c in hand_over.contributions] == ["a", "a", "b"]
    assert hand_over.contributors == {"a", "b"} and hand_over.samples == 6
    assert pool.take() is None
    counters = pool.counters()
    assert (counters.accepted_packets, counters.accepted_samples, counters.contributors) == (3, 6, 2)
    assert counters.pending_contributors == 0


def test_step_window_refuses_without_applying():
    pool = ContributionPool(min_contributors=1, current_step=lambda: 10)
    pool.add(_contribution("late", step=10 - LATE_WINDOW_STEPS))  # the oldest accepted
    for bad in (10 - LATE_WINDOW_STEPS - 1, 11):
        with pytest.raises(StepMismatch) as e:
            pool.add(_contribution("x", step=bad))
        assert e.value.server_step == 10
    assert pool.counters().accepted_packets == 1
    assert [c.step for c in pool.take().contributions] == [10 - LATE_WINDOW_STEPS]
    assert pool.take() is None


def test_concurrent_adds_are_all_handed_over_once():
    pool = ContributionPool(min_contributors=1, current_step=lambda: 1)
    woken = threading.Event()
    pool.on_ready(woken.set)
    per_thread, threads = 200, 4

    def submit(t: int) -> None:
        for i in range(per_thread):
            pool.add(_contribution(f"t{t}-{i}", step=1, samples=1))

    workers = [threading.Thread(target=submit, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    taken = []
    while True:  # take while they add, then until the pool is empty
        adding = any(w.is_alive() for w in workers)
        if (hand_over := pool.take()) is not None:
            taken.append(hand_over)
        elif not adding:
            break
    names = [c.contributor for h in taken for c in h.contributions]
    assert woken.is_set()
    assert len(names) == len(set(names)) == per_thread * threads
