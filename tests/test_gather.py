"""The sparse round's all-to-all exchange (node.lowcomm.gather) among real hivemind averagers on 127.0.0.1, two of
them client-mode peers that nobody can dial: every member ends the round with the same bits, the codec's average of
the four payloads, one of them the offer its node handed over instead of its `.grad`; and every member's record of
the round gives those bits. Who calls whom is tested in tests/test_gather_plan.py."""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import multiprocessing as mp
import os
import signal
import tempfile
import time
from functools import partial

import psutil
import pytest
import torch

from dtrain.node.lowcomm import record, sparse
from dtrain.node.lowcomm.gather import SparseGatherAverager
from dtrain.node.swarm.commit import AbortedRound
from tests.test_commit import applied, averagers

pytestmark = pytest.mark.swarm


ELEMENTS, FRACTION = 200_000, 0.1
OPTS = dict(min_matchmaking_time=2.0, allreduce_timeout=20.0, request_timeout=2.0)


def members(client_mode):
    g = torch.Generator().manual_seed(0)
    grads = [sparse.quantize(sparse.top_k([torch.randn(ELEMENTS, generator=g)], FRACTION))[0] for _ in client_mode]
    return averagers(lambda i, owner: partial(SparseGatherAverager, fraction=FRACTION, record_subkey=owner.subkey,
                                              client_mode=client_mode[i]), grads,
                     target_group_size=len(client_mode), min_group_size=len(client_mode), **OPTS)


def run(group, weight=None):
    """One round of every member: (its result, its .grad after the round, its round file's record). `weight`: every
    member's (by default its samples, 1)."""
    for _, averager in group:
        averager.accumulate_grads_(batch_size=1)
    controls = [averager.step(wait=False, timeout=30.0, allow_retries=False, weight=weight) for _, averager in group]
    outcomes = []
    for control, (param, averager) in zip(controls, group):
        result = control.result(60.0)
        with averager.use_averaged_gradients():
            grad = param.grad.clone()
        with tempfile.TemporaryFile() as f:
            averager.round_files.copy_record(f)
            f.seek(0)
            outcomes.append((result, grad, f.read()))
    return outcomes


def codec_average(offers, order):
    limit = sparse.kept(ELEMENTS, FRACTION)
    decoded = [sparse.decode(sparse.encode(offers[i], quantized=True), ELEMENTS, limit, quantized=True)
               for i in order]
    return sparse.average(decoded, [1.0] * len(order), ELEMENTS).numpy().tobytes()


def test_a_round_with_client_mode_members_ends_with_the_same_bits_on_every_member():
    limit = sparse.kept(ELEMENTS, FRACTION)
    with members([False, True, False, True]) as group:
        offers = [param.grad.clone() for param, _ in group]
        # the first member's node hands its averager the payload it built, and the averager sends it, not .grad;
        # the others handed none (their epoch is unknown: they are averaged)
        offers[0] = sparse.quantize([offers[0] * -2.0])[0]
        group[0][1].round_files.hand_offer(3, sparse.encode(offers[0], quantized=True))
        outcomes = run(group)
    for result, _, _ in outcomes:
        assert applied(result), result
        assert len(result) == 4, f"the round averaged {len(result)} members' payloads, not the group's four"
    results = [grad for _, grad, _ in outcomes]
    records = [rec for _, _, rec in outcomes]
    first = results[0].numpy().tobytes()
    assert all(r.numpy().tobytes() == first for r in results), "members ended the round with different bits"
    exact = torch.stack([o.double() for o in offers]).mean(0)
    assert torch.allclose(results[0].double(), exact, atol=1e-6)
    # and the bits are those of the codec's average of the four payloads, in some order of the group
    assert any(codec_average(offers, order) == first for order in itertools.permutations(range(4)))
    # each member's record of the round: the four payloads in the group's order, whose average is those bits
    assert len(set(records)) == 1
    members_of = record.parse(records[0], ELEMENTS, limit)
    payloads = {records[0][m.offset:m.offset + m.length] for m in members_of}
    assert payloads == {sparse.encode(o, quantized=True) for o in offers} and len(members_of) == 4
    out = torch.empty(ELEMENTS)
    record.average_into(records[0], members_of, [out], ELEMENTS, limit)
    assert out.numpy().tobytes() == first


def test_a_round_whose_members_brought_no_samples_is_aborted_on_every_member():
    """Full peers that joined for client-mode peers' samples and found only each other: the average of weights 0
    would be a zero gradient, an update (the outer step's momentum) that no samples asked for."""
    with members([False, False]) as group:
        outcomes = run(group, weight=0.0)
    assert all(isinstance(result, AbortedRound) and "no samples" in result.reason for result, _, _ in outcomes), \
        [result for result, _, _ in outcomes]


class Mortal(SparseGatherAverager):
    """A member that dies inside a round in which it is to call another member, before it calls: its own process is
    killed, and its libp2p daemon too when `daemon_pid` is set (or the daemon, in the test's process, stays: an averager
    gone while its node's connections stay open); `dies` is set by the test. As the last member of its group (it calls
    nobody) it takes part: the next round shuffles the group again."""

    def __init__(self, *args, **kwargs):
        self.dies = mp.RawValue(ctypes.c_bool, False)
        self.daemon_pid = mp.RawValue(ctypes.c_int, 0)
        super().__init__(*args, **kwargs)

    async def _exchange_holding(self, tensors, group_info, weight):
        if self.dies.value and group_info.peer_ids.index(self.peer_id) < len(group_info.peer_ids) - 1:
            if self.daemon_pid.value:
                os.kill(self.daemon_pid.value, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return await super()._exchange_holding(tensors, group_info, weight)


@pytest.mark.parametrize("daemon", ["killed", "outlives it"])
def test_a_member_killed_inside_the_round_ends_it_on_the_others_well_before_its_deadline(daemon):
    """The others stop waiting for a member that died before it called them: it has not called, and its averager
    fails their call (its daemon gone, or alive but with nobody to hand the call to), so the round cannot complete
    and ends within seconds, not at its deadline (here a minute)."""
    allreduce_timeout, tries = 60.0, 8
    g = torch.Generator().manual_seed(0)
    grads = [sparse.quantize(sparse.top_k([torch.randn(ELEMENTS, generator=g)], FRACTION))[0] for _ in range(3)]
    with averagers(lambda i, owner: partial(Mortal, fraction=FRACTION, record_subkey=owner.subkey), grads,
                   target_group_size=3, min_group_size=3,
                   min_matchmaking_time=2.0, allreduce_timeout=allreduce_timeout, request_timeout=2.0) as group:
        victim = group[-1][1]
        daemons = [p for p in psutil.Process(victim.dht.pid).children() if "p2pd" in p.name()]
        assert len(daemons) == 1, daemons
        victim_id = str(victim.peer_id)
        victim.dies.value = True
        if daemon == "killed":
            victim.daemon_pid.value = daemons[0].pid
        for _ in range(tries):  # until the victim is not the last of its group (each try: 1/3 that it is)
            for _, averager in group:
                averager.accumulate_grads_(batch_size=1)
            began = time.monotonic()
            controls = [averager.step(wait=False, timeout=allreduce_timeout, allow_retries=False)
                        for _, averager in group]
            results = [control.result(2 * allreduce_timeout) for control in controls[:-1]]
            took = time.monotonic() - began
            if victim.is_alive():
                assert all(applied(result) for result in results), results
                controls[-1].result(allreduce_timeout)
                continue
            break
        else:
            pytest.fail(f"the victim was the last of its group in {tries} rounds")
        if daemon == "outlives it":
            assert daemons[0].is_running()
        victim.dht.terminate()  # what is left of it: nothing to shut down gracefully
        with contextlib.suppress(psutil.NoSuchProcess):
            daemons[0].kill()
        # a member that waited for the victim names it; the other may have read that member's outcome first
        assert all(isinstance(result, AbortedRound) for result in results), results
        assert any(victim_id in result.reason for result in results), results
        assert took < 25.0, f"the others waited {took:.1f}s for a member that had died"


def _anon_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss_Anon:"))


class Measured(SparseGatherAverager):
    """A member whose process records what handing back the round's freed memory (`_hand_back`) gave the system."""

    def __init__(self, *args, **kwargs):
        self.handed_back = mp.RawValue(ctypes.c_longlong, -1)
        super().__init__(*args, **kwargs)

    def _hand_back(self) -> None:
        before = _anon_bytes()
        super()._hand_back()
        self.handed_back.value = before - _anon_bytes()


def test_a_round_hands_back_what_it_decoded():
    """The payloads a round decodes (8 bytes per element carried, a piece at a time) are free once averaged, and
    glibc keeps freed pieces in the process's heap: every member hands them back to the system after the round."""
    elements = 10_000_000
    decoded = 8 * sparse.kept(elements, FRACTION)  # int32 positions and f32 values of one member's payload
    g = torch.Generator().manual_seed(0)
    grads = [sparse.quantize(sparse.top_k([torch.randn(elements, generator=g)], FRACTION))[0] for _ in range(2)]
    with averagers(lambda i, owner: partial(Measured, fraction=FRACTION, record_subkey=owner.subkey), grads,
                   target_group_size=2, min_group_size=2, **OPTS) as group:
        outcomes = run(group)
        assert all(applied(result) for result, _, _ in outcomes), outcomes
        handed_back = [averager.handed_back.value for _, averager in group]
    assert all(b >= decoded for b in handed_back), f"handed back {handed_back} bytes, one payload decodes to {decoded}"
