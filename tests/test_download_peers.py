"""A download written into the node's tensors as it arrives (node.swarm.state.SwarmStateAverager.load_state_from_peers,
node.swarm.download), between real hivemind state averagers on 127.0.0.1.

The donors serve as every node did before (hivemind's rpc_download_state, one moment's copy): the wire is unchanged.
A donor whose state holds a non-finite number is skipped for the next one, after it wrote the tensors
before that number; alone, it leaves the joiner `torn` (its epoch unchanged, sharing nothing) until a whole download
replaces what it wrote.
"""
from __future__ import annotations

import asyncio
import math
import os
import time

import hivemind
import pytest
import torch
from hivemind.proto import averaging_pb2

from dtrain.node import memory
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


def new_files_held(averager: SwarmStateAverager, before: set) -> int:
    """Bytes of shared memory the averager's process maps in files it did not map `before`: the copies of the state
    it was handed for downloads (whatever it inherited from this process, earlier tests' tensors too, is older)."""
    return sum(size for key, size in memory.shared_files(averager.pid).items() if key not in before)


def test_a_donor_hands_back_each_tensor_of_its_copy_once_sent(peers):
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(2048, 1024, generator=gen)) for _ in range(2)]  # 16 MiB; 48 with AdamW's
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    older = memory.shared_zeros(4 << 20).fill_(1.0)  # shared memory of this process's own, which the donor inherits
    donor = peers(opt, epoch=3, priority=1.0)
    before = set(memory.shared_files(donor.pid))
    assert sum(memory.shared_files(donor.pid).values()) >= (48 << 20) + 4 * older.numel()  # its state, inherited
    dht = hivemind.DHT(host_maddrs=LOCAL, start=True,
                       initial_peers=[str(m) for m in donor.dht.get_visible_maddrs()])

    async def first_part_then_hold():
        """Ask the donor for its state as a joiner does, read the first part and hold the stream open."""
        p2p = await dht.replicate_p2p()
        stub = SwarmStateAverager.get_stub(p2p, donor.peer_id, namespace=donor.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        first = await stream.__anext__()
        assert first.metadata  # hivemind's first part carries the metadata
        await asyncio.sleep(2.0)  # the donor serializes ahead as far as the transport takes
        held = new_files_held(donor, before)
        await stream.aclose()
        return held

    try:
        held = asyncio.run(first_part_then_hold())
    finally:
        dht.shutdown()
    # the copy made for this download is 48 MiB; the first tensor (8 MiB) was serialized and sent: its pages went
    # (besides: a page or so of each small shared file of hivemind's, and of the copies' AdamW steps)
    assert held <= (48 - 8 << 20) + (1 << 20)
    deadline = time.monotonic() + 10.0
    while new_files_held(donor, before) > 1 << 20:  # the stream closed: the rest goes too
        assert time.monotonic() < deadline, f"the donor still holds {new_files_held(donor, before)} bytes of its copy"
        time.sleep(0.2)
