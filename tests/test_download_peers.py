"""A download written into the node's tensors as it arrives (node.swarm.state.SwarmStateAverager.load_state_from_peers,
node.swarm.download), between real hivemind state averagers on 127.0.0.1.

The donors serve as every node did before (hivemind's rpc_download_state, one moment's copy): the wire is unchanged.
A donor whose state holds a non-finite number is skipped for the next one, after it wrote the tensors
before that number; alone, it leaves the joiner `torn` (its epoch unchanged, sharing nothing) until a whole download
replaces what it wrote.
"""
from __future__ import annotations

import math
import time

import hivemind
import pytest
import torch

from dtrain.node.swarm.state import SwarmStateAverager, keep_state_shared
from tests.test_keygate import LOCAL

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

PREFIX = "download_state_averager"
WAIT_S = 60.0


def adamw(seed: int, stepped: bool = True) -> torch.optim.AdamW:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(40, 30, generator=gen)), torch.nn.Parameter(torch.randn(30, generator=gen))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    if stepped:
        opt.step()
    return opt


def state_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = [p for group in opt.param_groups for p in group["params"]]
    return [p.detach() for p in params] + [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq", "step")]


@pytest.fixture
def peers():
    started = []

    def start(opt, epoch: int, priority: float):
        dht = hivemind.DHT(host_maddrs=LOCAL, start=True, initial_peers=(
            [str(m) for m in started[0][0].get_visible_maddrs()] if started else []))
        averager = SwarmStateAverager(dht=dht, prefix=PREFIX, optimizer=keep_state_shared(opt), start=True,
                                      swarm_key=None)
        averager.local_epoch, averager.state_sharing_priority = epoch, priority
        started.append((dht, averager))
        return averager

    try:
        yield start
    finally:
        for dht, averager in reversed(started):
            averager.shutdown()
            dht.shutdown()


def load_until(joiner: SwarmStateAverager, done, what: str) -> None:
    """Download until `done()` (the donors' declarations reach the DHT within seconds)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        joiner.load_state_from_peers(timeout=30.0)
        if done():
            return
        assert time.monotonic() < deadline, f"no download gave {what} within {WAIT_S:.0f}s"
        time.sleep(0.5)


def test_the_download_is_written_into_the_joiners_tensors_and_a_bad_donor_is_skipped(peers):
    good_opt = adamw(seed=1)
    good = peers(good_opt, epoch=5, priority=1.0)
    want = [t.clone() for t in state_of(good_opt)]

    bad_opt = adamw(seed=2)
    with torch.no_grad():
        bad_opt.state[bad_opt.param_groups[0]["params"][1]]["exp_avg"][3] = math.nan  # after both parameters
    bad = peers(bad_opt, epoch=9, priority=2.0)  # asked first
    bad_state = [t.clone() for t in state_of(bad_opt)]

    joiner_opt = adamw(seed=3, stepped=False)
    joiner = peers(joiner_opt, epoch=0, priority=0.0)
    mine = state_of(joiner_opt)
    pointers = [t.data_ptr() for t in mine]
    assert joiner._stream is not None  # the averager's process writes the node's tensors

    load_until(joiner, lambda: joiner.local_epoch == 5, "the good donor's epoch")
    assert not joiner.torn and joiner.allow_state_sharing
    now = state_of(joiner_opt)
    assert all(torch.equal(a, b) for a, b in zip(now, want)), "not the good donor's state, bit for bit"
    assert [t.data_ptr() for t in now] == pointers and all(a is b for a, b in zip(now[2:], mine[2:]))  # in place

    # alone, the bad donor writes its parameters, then fails: torn, the epoch and the rest as they were
    good.allow_state_sharing = False
    load_until(joiner, lambda: joiner.torn, "a torn download")
    assert joiner.local_epoch == 5 and not joiner.allow_state_sharing
    now = state_of(joiner_opt)  # as sent: both parameters, then the first one's state, then the NaN
    assert all(torch.equal(a, b) for a, b in zip(now[:5], bad_state[:5]))
    assert all(torch.equal(a, b) for a, b in zip(now[5:], want[5:]))

    # a whole download replaces what the failed one wrote
    good.allow_state_sharing = True
    bad.allow_state_sharing = False
    load_until(joiner, lambda: not joiner.torn, "a whole download")
    assert all(torch.equal(a, b) for a, b in zip(state_of(joiner_opt), want))
    assert joiner.local_epoch == 5
