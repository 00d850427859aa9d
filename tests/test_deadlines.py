"""The swarm's round deadlines: which bytes they are sized for in each sync mode, and the clock that moves them."""
from __future__ import annotations

import dataclasses

import pytest

from dtrain.node.config import SwarmConfig
from dtrain.node.lowcomm import codec, sparse
from dtrain.node.swarm.deadlines import (DEADLINE_PEERS, STATE_BYTES_PER_ELEMENT, RoundClock, round_sizes,
                                        swarm_deadlines)

pytestmark = pytest.mark.unit

P = 124_000_000  # GPT-2 small


def test_sizes_per_mode():
    sparse_cfg = SwarmConfig(topk_fraction=0.2)
    sizes = round_sizes(sparse_cfg, P)
    assert sizes.deadline_bytes == pytest.approx(P * sparse.bytes_per_element(0.2) * (DEADLINE_PEERS - 1))
    assert sizes.exchange_bytes(2) == pytest.approx(P * sparse.bytes_per_element(0.2))
    fp16 = round_sizes(dataclasses.replace(sparse_cfg, wire_codec="fp16"), P)
    assert fp16.deadline_bytes == 4.0 * P and fp16.exchange_bytes(2) == codec.allreduce_bytes(P, 2, 2.0)
    per_step = round_sizes(SwarmConfig(sync="per-step"), P)  # the state round: parameters and two moments
    assert per_step.deadline_bytes == codec.allreduce_bytes(3 * P, DEADLINE_PEERS, 4.0)
    assert per_step.exchange_bytes(3) == codec.allreduce_bytes(P, 3, 4.0)


def test_the_first_deadline_is_the_link_s_in_low_comm_and_the_floor_in_per_step_mode():
    low, deadlines, _ = swarm_deadlines(SwarmConfig(link_mbit=10.0, averaging_timeout_s=30.0), P)
    assert low.averaging_timeout_s == pytest.approx(3.0 * deadlines.sized_bytes / 1.25e6)
    assert low.averaging_timeout_s > 30.0
    assert deadlines.floor_s == 30.0  # the configured value stays the floor
    step, deadlines, _ = swarm_deadlines(SwarmConfig(sync="per-step", link_mbit=10.0, averaging_timeout_s=30.0), P)
    assert step.averaging_timeout_s == 30.0 and deadlines.link_mbit == 0.0  # --link-mbit is a low-comm rate


def test_a_state_download_may_take_what_the_state_needs_at_the_link_rate():
    low, _, _ = swarm_deadlines(SwarmConfig(link_mbit=10.0, load_state_timeout_s=120.0), P)
    state = P * STATE_BYTES_PER_ELEMENT["low-comm"]  # parameters and outer momentum: 992 MB
    assert low.load_state_timeout_s == pytest.approx(3.0 * state / 1.25e6) and low.load_state_timeout_s > 120.0
    small, _, _ = swarm_deadlines(SwarmConfig(link_mbit=10.0, load_state_timeout_s=120.0), 1_000_000)
    assert small.load_state_timeout_s == 120.0  # the configured bound is the floor
    step, _, _ = swarm_deadlines(SwarmConfig(sync="per-step", link_mbit=10.0, load_state_timeout_s=120.0), P)
    assert step.load_state_timeout_s == 120.0  # --link-mbit is a low-comm rate


def test_the_clock_moves_the_deadline_with_measured_rounds_and_says_what_ran_out():
    config, deadlines, sizes = swarm_deadlines(SwarmConfig(link_mbit=0.0, averaging_timeout_s=30.0), 1_000_000)
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
