"""The swarm's round deadlines: from bytes and rate, which bytes they are sized for in each sync mode, the measured
throughput that moves them and the clock that sets them."""
from __future__ import annotations

import dataclasses

import pytest

from dtrain.node.config import SwarmConfig
from dtrain.node.lowcomm import momentum as momentum8
from dtrain.node.lowcomm import sparse
from dtrain.node.lowcomm.codec import round_sizes
from dtrain.node.swarm.deadlines import (DEADLINE_PEERS, STATE_BYTES_PER_ELEMENT, RoundClock, RoundDeadlines,
                                        Throughput, allreduce_bytes, per_step_sizes, round_deadline, swarm_deadlines)

pytestmark = pytest.mark.unit

P = 124_000_000  # GPT-2 small


def test_sizes_per_mode():
    sparse_cfg = SwarmConfig(topk_fraction=0.2)
    sizes = round_sizes(sparse_cfg, P)
    assert sizes.deadline_bytes == pytest.approx(P * sparse.bytes_per_element(0.2) * (DEADLINE_PEERS - 1))
    assert sizes.exchange_bytes(2) == pytest.approx(P * sparse.bytes_per_element(0.2))
    fp16 = round_sizes(dataclasses.replace(sparse_cfg, wire_codec="fp16"), P)
    assert fp16.deadline_bytes == 4.0 * P and fp16.exchange_bytes(2) == allreduce_bytes(P, 2, 2.0)
    per_step = per_step_sizes(P)  # the state round: parameters and two moments
    assert per_step.deadline_bytes == allreduce_bytes(3 * P, DEADLINE_PEERS, 4.0)
    assert per_step.exchange_bytes(3) == allreduce_bytes(P, 3, 4.0)


def deadlines_of(config: SwarmConfig, elements: int = P):
    sizes = round_sizes(config, elements) if config.sync == "low-comm" else per_step_sizes(elements)
    return (*swarm_deadlines(config, elements, sizes), sizes)


def test_the_first_deadline_is_the_link_s_in_low_comm_and_the_floor_in_per_step_mode():
    low, deadlines, _ = deadlines_of(SwarmConfig(link_mbit=10.0, averaging_timeout_s=30.0))
    assert low.averaging_timeout_s == pytest.approx(3.0 * deadlines.sized_bytes / 1.25e6)
    assert low.averaging_timeout_s > 30.0
    assert deadlines.floor_s == 30.0  # the configured value stays the floor
    step, deadlines, _ = deadlines_of(SwarmConfig(sync="per-step", link_mbit=10.0, averaging_timeout_s=30.0))
    assert step.averaging_timeout_s == 30.0 and deadlines.link_mbit == 0.0  # --link-mbit is a low-comm rate


def test_a_state_download_may_take_what_the_state_needs_at_the_link_rate():
    low, _, _ = deadlines_of(SwarmConfig(link_mbit=10.0, load_state_timeout_s=120.0))
    # f32 parameters and the outer momentum in 8 bits (the form the swarm keeps it in): 622 MB
    assert STATE_BYTES_PER_ELEMENT["low-comm"] == momentum8.STATE_BYTES_PER_ELEMENT
    state = P * STATE_BYTES_PER_ELEMENT["low-comm"]
    assert low.load_state_timeout_s == pytest.approx(3.0 * state / 1.25e6) and low.load_state_timeout_s > 120.0
    small, _, _ = deadlines_of(SwarmConfig(link_mbit=10.0, load_state_timeout_s=120.0), 1_000_000)
    assert small.load_state_timeout_s == 120.0  # the configured bound is the floor
    step, _, _ = deadlines_of(SwarmConfig(sync="per-step", link_mbit=10.0, load_state_timeout_s=120.0))
    assert step.load_state_timeout_s == 120.0  # --link-mbit is a low-comm rate


def test_the_clock_moves_the_deadline_with_measured_rounds_and_says_what_ran_out():
    config, deadlines, sizes = deadlines_of(SwarmConfig(link_mbit=0.0, averaging_timeout_s=30.0), 1_000_000)
    clock = RoundClock(deadlines, sizes)
    assert clock.deadline.seconds == 30.0
    assert clock.completed(peers=2, exchange_s=0.5) is None  # fast: the floor, unchanged
    spent, longer = clock.ran_out()
    assert spent.seconds == 30.0 and "30s" in spent.why and longer.seconds == pytest.approx(60.0)
    assert clock.deadline is longer
    # a round among 2 that took 40 s: the rate its bytes show, sized for a group of DEADLINE_PEERS
    moved = clock.completed(peers=2, exchange_s=40.0)
    rate = 0.5 * sizes.exchange_bytes(2) / 40.0 + 0.5 * 3.0 * sizes.deadline_bytes / 60.0
    assert moved.seconds == pytest.approx(3.0 * sizes.deadline_bytes / rate) and "measured" in moved.why
    # a round at the estimated rate: the estimate stays, and so do the swarm's bounds
    assert clock.completed(peers=2, exchange_s=sizes.exchange_bytes(2) / rate) is None
    assert clock.deadline is moved


def test_allreduce_bytes():
    assert allreduce_bytes(1000, 1, 4.0) == 0.0
    assert allreduce_bytes(1000, 2, 4.0) == 4000.0
    assert allreduce_bytes(900, 3, 1.0) == 1200.0


def test_deadline_grows_with_bytes_and_keeps_the_floor():
    d = round_deadline(250e6, floor_s=30.0, link_mbit=20.0)
    assert d.seconds == pytest.approx(3.0 * 250e6 / 2.5e6) and "20 Mbit/s" in d.why
    assert round_deadline(1e6, floor_s=30.0, link_mbit=20.0).seconds == 30.0
    assert round_deadline(250e6, floor_s=30.0).seconds == 30.0  # nothing known: the floor
    slow = round_deadline(250e6, floor_s=30.0, link_mbit=100.0, measured_bps=1e6)
    assert slow.seconds == pytest.approx(750.0) and "measured" in slow.why  # the slower of the two


def test_throughput_estimate_ignores_empty_rounds():
    t = Throughput()
    t.observe(0, 1.0)
    t.observe(10.0, 0.0)
    assert t.bps is None
    t.observe(100.0, 1.0)
    t.observe(300.0, 1.0)
    assert t.bps == pytest.approx(200.0)


def test_a_completed_round_measures_the_rate_and_only_a_slower_one_than_the_link_lengthens_the_deadline():
    d = RoundDeadlines(sized_bytes=250e6, floor_s=30.0, link_mbit=20.0)  # 300 s at 2.5 MB/s, x3
    assert d.current().seconds == pytest.approx(300.0)
    d.completed(100e6, 10.0)  # 10 MB/s: faster than the link, which still decides
    assert d.current().seconds == pytest.approx(300.0) and "20 Mbit/s" in d.current().why
    d.completed(10e6, 10.0)  # 1 MB/s: the running estimate is 5.5 MB/s, still faster than the link
    assert d.current().seconds == pytest.approx(300.0)
    d.completed(1e6, 10.0)  # 0.1 MB/s now (a busy host, or a slower link): 2.8 MB/s, then 0.1 MB/s measured
    d.completed(1e6, 10.0)
    slow = d.current()
    assert slow.seconds == pytest.approx(3.0 * 250e6 / (0.25 * 5.5e6 + 0.5 * 1e5 + 0.25 * 1e5))
    assert "measured" in slow.why
    for _ in range(20):  # the link recovers: the estimate follows, and the link's rate bounds it again
        d.completed(100e6, 10.0)
    assert d.current().seconds == pytest.approx(300.0)


def test_a_round_that_ran_out_doubles_the_next_deadline_until_one_completes():
    # no rate configured and a fast first measurement: the floor; then the link slows down and rounds run out,
    # which measure nothing: without growing, the deadline would stay at the floor and every round abort
    d = RoundDeadlines(sized_bytes=250e6, floor_s=30.0, link_mbit=0.0)
    d.completed(1e9, 1.0)
    assert d.current().seconds == 30.0
    seconds = [30.0]
    for _ in range(3):
        d.ran_out(seconds[-1])
        seconds.append(d.current().seconds)
    assert seconds == pytest.approx([30.0, 60.0, 120.0, 240.0])
    d.completed(250e6 / 200.0 * 1.0, 1.0)  # the round at 240 s completed: the link moves its bytes in 200 s
    assert d.current().seconds == pytest.approx(3.0 * 250e6 / (0.5 * 250e6 / 200.0 + 0.5 * 3.0 * 250e6 / 240.0))
    for _ in range(10):  # rounds that keep running out (a member frozen in each) stop growing it at 16x the first
        d.ran_out(d.current().seconds)
    assert d.current().seconds == pytest.approx(16 * 30.0)
    # the link's rate is a lower bound the measurement never goes past; a run-out one below it still grows
    d = RoundDeadlines(sized_bytes=250e6, floor_s=30.0, link_mbit=20.0)
    d.ran_out(d.current().seconds)
    assert d.current().seconds == pytest.approx(600.0) and "ran out of time" in d.current().why
