"""The low-communication mode's pure parts: wire codecs and their byte counts, the outer Nesterov step, and one node's round bookkeeping (nothing dropped, nothing twice)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor

from dtrain.node import memory
from dtrain.node.lowcomm import codec
from dtrain.node.lowcomm import momentum as momentum8
from dtrain.node.lowcomm.outer import OuterNesterov, nesterov_
from dtrain.node.lowcomm.rounds import InnerRounds

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name,tol", [("fp32", 0.0), ("fp16", 1e-3)])
def test_codecs_round_trip_within_their_precision_and_cost_their_bytes(name, tol):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    wire = serialize_torch_tensor(x, codec.compression(name).compression_type)
    back = deserialize_torch_tensor(wire)
    assert back.shape == x.shape
    assert float((back - x).abs().max()) <= tol * float(x.abs().max()) + 1e-12
    assert len(wire.buffer) <= codec.bytes_per_element(name) * x.numel() + 64


def test_unknown_codec_is_a_typed_error():
    with pytest.raises(codec.UnknownCodec):
        codec.compression("top1")


def momentum_of(outer: OuterNesterov, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return outer.state[p]["momentum_codes"], outer.state[p]["momentum_scales"]


def set_momentum(outer: OuterNesterov, p: torch.Tensor, values: torch.Tensor) -> None:
    momentum8.quantize_(values, *momentum_of(outer, p))


def test_outer_nesterov_is_torch_sgd_with_the_momentum_kept_in_8_bits_and_passthrough_is_the_inner_update():
    torch.manual_seed(0)
    n = 2 * momentum8.BLOCK + 37  # two whole blocks and a shorter one
    a, b = torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(n))
    b.data.copy_(a.data)
    mine, ref = OuterNesterov([a], lr=0.7, momentum=0.9), torch.optim.SGD([b], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(3):
        g = torch.randn(n)
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        ref.step()
        buf = ref.state[b]["momentum_buffer"]  # torch's step with the f32 momentum, then the momentum rounded
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
        assert momentum_of(mine, a)[0].dtype == torch.int8 and momentum_of(mine, a)[1].shape == (3,)
        codes, scales = momentum8.zeros(buf)
        momentum8.quantize_(buf, codes, scales)
        assert torch.equal(codes, momentum_of(mine, a)[0]) and torch.allclose(scales, momentum_of(mine, a)[1])
        buf.copy_(momentum8.dequantize(codes, scales))
        assert (buf - momentum8.dequantize(*momentum_of(mine, a))).abs().max() <= 1e-6
    before, kept = a.detach().clone(), [t.clone() for t in momentum_of(mine, a)]
    mine.passthrough = True
    inner = before - torch.linspace(-1e-3, 1.0, n)  # where an inner update took the parameters
    a.grad = before - inner
    mine.step()
    assert torch.allclose(a.detach(), inner, rtol=0, atol=1e-7)
    assert all(torch.equal(x, y) for x, y in zip(momentum_of(mine, a), kept))
    with pytest.raises(ValueError):
        OuterNesterov([a], lr=0.0)


def _rounds(steps=2):
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    inner = torch.optim.SGD([p], lr=0.5)
    return p, InnerRounds([p], inner, steps)


def test_a_settled_round_starts_the_next_from_the_outer_update():
    p, r = _rounds()
    r.inner_step([torch.tensor([1.0, 0.0, 0.0])])
    assert not r.due
    r.inner_step([torch.tensor([1.0, 0.0, 0.0])])
    assert r.due
    r.enter_outer()
    assert torch.equal(p.detach(), torch.tensor([1.0, 2.0, 3.0]))  # the outer step starts at the anchor
    assert torch.equal(r.pseudo_gradient()[0], torch.tensor([1.0, 0.0, 0.0]))
    with torch.no_grad():
        p.sub_(r.pseudo_gradient()[0])  # an outer step of lr 1
    r.settle()
    assert r.steps == 0 and not r.in_outer
    assert torch.equal(r.anchor[0], torch.tensor([0.0, 2.0, 3.0]))
    assert torch.equal(r.pseudo_gradient()[0], torch.zeros(3))


def test_a_missed_round_carries_the_pseudo_gradient_once_onto_the_swarms_bytes():
    p, r = _rounds()
    r.inner_step([torch.tensor([2.0, 0.0, 0.0])])  # delta [1, 0, 0]
    r.enter_outer()
    with torch.no_grad():
        p.copy_(torch.tensor([10.0, 20.0, 30.0]))  # the swarm's bytes, downloaded: they hold none of this node's work
    r.carry()
    assert torch.equal(r.anchor[0], torch.tensor([10.0, 20.0, 30.0]))
    assert torch.equal(p.detach(), torch.tensor([9.0, 20.0, 30.0]))
    assert r.steps == 1  # still counted toward the next round
    r.inner_step([torch.tensor([0.0, 2.0, 0.0])])
    assert torch.equal(r.pseudo_gradient()[0], torch.tensor([1.0, 1.0, 0.0]))  # carried + new, each once


def test_no_update_returns_to_the_inner_parameters_and_carry_needs_enter():
    p, r = _rounds()
    r.inner_step([torch.tensor([2.0, 0.0, 0.0])])
    inner = p.detach().clone()
    r.enter_outer()
    r.leave_outer()
    assert torch.equal(p.detach(), inner)
    with pytest.raises(RuntimeError):
        r.carry()


def test_the_anchor_reads_the_served_snapshot_when_it_holds_the_same_bytes():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    served = [np.array([1.0, 2.0, 3.0], np.float32)]
    served[0].setflags(write=False)  # as a snapshot's arrays are
    r = InnerRounds([p], torch.optim.SGD([p], lr=0.5), 2, published=lambda: served)
    r.inner_step([torch.tensor([1.0, 0.0, 0.0])])
    assert r.anchor[0].data_ptr() == served[0].ctypes.data  # no copy of its own
    r.inner_step([torch.tensor([1.0, 0.0, 0.0])])
    r.enter_outer()
    assert torch.equal(p.detach(), torch.tensor([1.0, 2.0, 3.0])) and torch.equal(
        r.pseudo_gradient()[0], torch.tensor([1.0, 0.0, 0.0]))
    with torch.no_grad():
        p.sub_(r.pseudo_gradient()[0])
    r.settle()  # the node has not published the new bytes yet: the anchor is a copy, and the snapshot is untouched
    assert r.anchor[0].data_ptr() != served[0].ctypes.data and torch.equal(r.anchor[0], torch.tensor([0.0, 2.0, 3.0]))
    r.inner_step([torch.tensor([0.0, 1.0, 0.0])])  # still other bytes than the served ones: it keeps its copy
    assert r.anchor[0].data_ptr() != served[0].ctypes.data and np.array_equal(served[0], [1.0, 2.0, 3.0])


def test_settle_takes_the_next_snapshots_bytes_as_the_anchor():
    p, r = _rounds()
    r.inner_step([torch.tensor([1.0, 0.0, 0.0])])
    r.enter_outer()
    with torch.no_grad():
        p.sub_(r.pseudo_gradient()[0])
    stale = [np.array([9.0, 9.0, 9.0], np.float32)]
    served = [np.array([0.5, 2.0, 3.0], np.float32)]
    r.settle(served=stale)  # not the parameters' bytes: a copy of its own
    assert r.anchor[0].data_ptr() != stale[0].ctypes.data and torch.equal(r.anchor[0], p.detach())
    r.inner_step([torch.tensor([1.0, 0.0, 0.0])])
    r.enter_outer()
    with torch.no_grad():
        p.copy_(torch.tensor([0.5, 2.0, 3.0]))  # an outer update
    r.settle(served=served)  # the snapshot the node publishes next holds these bytes: read there
    assert r.anchor[0].data_ptr() == served[0].ctypes.data and torch.equal(r.anchor[0], p.detach())


def _round_with_outer(n: int, seed: int = 0):
    """A parameter after one inner update, its gradient buffer (shared, as a node's), and the outer optimizer."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = memory.shared_zeros(n)
    r = InnerRounds([p], torch.optim.SGD([p], lr=0.5), 1)
    r.inner_step([torch.randn(n)])
    outer = OuterNesterov([p], lr=0.7, momentum=0.9)
    set_momentum(outer, p, torch.randn(n))
    return p, r, outer


def test_the_outer_step_goes_from_the_anchor_with_no_copy_of_the_parameters():
    n = 1 << 16
    p, r, outer = _round_with_outer(n)
    anchor, inner = r.anchor[0].clone(), p.detach().clone()
    average = torch.randn(n)
    # as it was done: the parameters back at the anchor, a copy of the inner updates' values set aside
    expected_p, expected_momentum = anchor.clone(), [t.clone() for t in momentum_of(outer, p)]
    nesterov_(expected_p, average.clone(), *expected_momentum, 0.7, 0.9)
    outer.source = r.begin()
    assert r.holds_inner() and r._inner is None and torch.equal(p.detach(), inner)  # nothing copied or moved
    with torch.no_grad():
        p.grad.copy_(average)  # the round's average, where hivemind's averager writes it
    outer.step()
    assert p.detach().numpy().tobytes() == expected_p.numpy().tobytes()  # bit for bit
    assert [t.numpy().tobytes() for t in momentum_of(outer, p)] == [t.numpy().tobytes() for t in expected_momentum]
    assert r.pseudo_gradient()[0].numpy().tobytes() == (anchor - inner).numpy().tobytes()  # left in .grad
    with pytest.raises(RuntimeError):
        r.inner_parameter(0)  # gone: nothing holds it
    r.enter_outer()  # a download after the step (following another peer's bytes) copies nothing
    assert r._inner is None
    r.applied()  # the update applied the offer: .grad goes before the node makes the update's snapshot
    assert not p.grad.any() and r.in_outer
    with pytest.raises(RuntimeError):
        r.carry()  # the pseudo-gradient is gone: only settle may follow
    r.settle()
    assert torch.equal(r.anchor[0], p.detach()) and not r.in_outer and not p.grad.any()


def test_a_round_whose_update_went_without_this_node_carries_the_pseudo_gradient_from_grad():
    p, r, outer = _round_with_outer(64, seed=1)
    anchor, inner = r.anchor[0].clone(), p.detach().clone()
    outer.source = r.begin()
    with torch.no_grad():
        p.grad.copy_(torch.randn(64))
    outer.step()
    swarm = torch.randn(64)
    with torch.no_grad():
        p.copy_(swarm)  # the peers' bytes, downloaded: this node's update was not the swarm's
    r.carry()
    assert torch.equal(r.anchor[0], swarm) and torch.equal(p.detach(), swarm - (anchor - inner))
    assert not r.in_outer and r.steps == 1  # its inner update counts toward the next round


def test_a_round_with_no_update_leaves_the_parameters_untouched():
    p, r, outer = _round_with_outer(64, seed=2)
    inner = p.detach().clone()
    r.begin()
    with torch.no_grad():
        p.grad.copy_(r.offer()[0])
    r.leave_outer()
    assert torch.equal(p.detach(), inner) and not r.in_outer and not p.grad.any()


def test_a_download_inside_the_round_sets_the_parameters_aside_and_the_step_goes_from_its_bytes():
    p, r, outer = _round_with_outer(64, seed=3)
    anchor, inner = r.anchor[0].clone(), p.detach().clone()
    outer.source = r.begin()
    r.enter_outer()  # what SwarmOptimizer.before_state_load does before a download
    assert torch.equal(p.detach(), anchor) and torch.equal(r._inner[0], inner)
    downloaded, average = torch.randn(64), torch.randn(64)
    expected = downloaded.clone()
    nesterov_(expected, average.clone(), *[t.clone() for t in momentum_of(outer, p)], 0.7, 0.9)
    with torch.no_grad():
        p.copy_(downloaded)
        p.grad.copy_(average)
    outer.step()
    assert torch.equal(p.detach(), expected)  # from the downloaded bytes, not the anchor
    stepped = p.detach().clone()
    r.carry()
    assert torch.equal(p.detach(), stepped - (anchor - inner)) and torch.equal(r.anchor[0], stepped)


def test_a_node_alone_lands_on_its_inner_parameters_with_no_copy():
    n = 1 << 20
    p = torch.nn.Parameter(torch.linspace(0.0, 1.0, n))
    p.grad = memory.shared_zeros(n)
    r = InnerRounds([p], torch.optim.SGD([p], lr=0.5), 1)
    r.inner_step([torch.ones(n)])
    inner = p.detach().clone()
    outer = OuterNesterov([p])
    outer.passthrough, outer.source = True, r.begin()
    with torch.no_grad():
        p.grad.copy_(r.offer(compress=False)[0])
    momentum = [t.clone() for t in momentum_of(outer, p)]
    outer.step()
    assert torch.equal(p.detach(), inner) and r._inner is None and not r._moved  # it never left
    assert all(torch.equal(x, y) for x, y in zip(momentum_of(outer, p), momentum))
    r.landed()
    assert not p.grad.any()  # the gradient buffers are released
    assert torch.equal(r.pseudo_gradient()[0], r.anchor[0] - inner)
    r.settle()
    assert torch.equal(p.detach(), inner) and torch.equal(r.anchor[0], inner) and not r.in_outer


def test_a_node_alone_lands_on_the_set_aside_parameters_bit_for_bit():
    p, r, outer = _round_with_outer(64, seed=4)
    inner = p.detach().clone()
    outer.passthrough, outer.source = True, r.begin()
    r.enter_outer()  # set aside (a download came, and loaded the anchor's bytes again)
    with torch.no_grad():
        p.grad.copy_(r.offer(compress=False)[0])
    outer.step()
    assert torch.equal(p.detach(), inner)  # copied back, not anchor - pseudo-gradient (a last bit off)
    r.landed()
    assert r._inner is None and not p.grad.any()  # the copy went
    r.settle()
    assert torch.equal(r.anchor[0], inner)


def test_landed_keeps_the_set_aside_parameters_when_the_step_put_others():
    p, r = _rounds(steps=1)
    r.inner_step([torch.tensor([1.0, 0.0, 0.0])])
    r.begin()
    r.enter_outer()
    kept = r._inner[0]
    with torch.no_grad():
        p.copy_(torch.tensor([7.0, 7.0, 7.0]))  # not where the inner updates left them (a download came)
    r.landed()
    assert r._inner[0] is kept
    r.carry()
    assert torch.equal(p.detach(), torch.tensor([6.5, 7.0, 7.0]))  # the pseudo-gradient [0.5, 0, 0] on top, once


def _shmem_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def test_the_gradient_buffers_hold_memory_only_while_used():
    n = 4 << 20  # 16 MiB
    p, twin = torch.nn.Parameter(torch.zeros(n)), torch.nn.Parameter(torch.zeros(n))
    p.grad = buffer = memory.shared_zeros(n)  # as a node's are (node.swarm.state.keep_state_shared)
    r = InnerRounds([p], torch.optim.AdamW([p], lr=0.1), 2)
    grad = torch.linspace(-1.0, 1.0, n)
    before = _shmem_kib()
    r.inner_step([grad])
    twin.grad = grad.clone()
    torch.optim.AdamW([twin], lr=0.1).step()
    assert torch.equal(p.detach(), twin.detach())  # the update used the gradient, exactly
    assert _shmem_kib() - before < 1024  # then it went (read first: a read of a released page takes one again)
    assert p.grad is buffer and not buffer.any()
    r.enter_outer()
    with torch.no_grad():
        buffer.copy_(r.offer()[0])  # the outer round's offer, as the node writes it for hivemind's averager
    assert _shmem_kib() - before >= 15 << 10
    r.leave_outer()  # no update: the round is over all the same
    assert _shmem_kib() - before < 1024
    assert p.grad is buffer and not buffer.any()


def test_the_anchor_shares_the_served_bytes_once_they_are_published():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    served = [np.array([1.0, 2.0, 3.0], np.float32)]
    r = InnerRounds([p], torch.optim.SGD([p], lr=0.5), 2, published=lambda: served)
    assert r.anchor[0].data_ptr() != served[0].ctypes.data  # a copy until the node says it serves them
    r.share_anchor()
    assert r.anchor[0].data_ptr() == served[0].ctypes.data


def _lifecycle(resident: bool) -> dict:
    """Rounds of a node whose inner loop trains the parameters themselves, or a resident copy of them (on a GPU, the
    device's; here a second copy on the CPU, through the same code): an update that applies the sparse offer, then
    a download that replaces the parameters and a carried round. What it leaves, as bytes."""
    torch.manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(20, 10))]
    for p in params:
        p.grad = memory.shared_zeros(p.numel()).view_as(p)
    trained = [torch.nn.Parameter(p.detach().clone()) for p in params] if resident else None
    inner = torch.optim.AdamW(trained or params, lr=0.01)
    r = InnerRounds(params, inner, inner_steps=2, fraction=0.25, trained=trained)
    outer = OuterNesterov(params, lr=0.7, momentum=0.9)
    seen = {}
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        before = [p.detach().clone() for p in params]
        r.inner_step([torch.randn(p.shape, generator=gen) for p in params])
        # a resident loop leaves the parameters alone between rounds: nothing crosses per inner update
        seen["params moved by inner updates"] = any(not torch.equal(b, p.detach()) for b, p in zip(before, params))
    outer.source = r.begin()
    seen["offer"] = [o.numpy().tobytes() for o in r.offer(compress=True)]
    with torch.no_grad():
        for p, o in zip(params, r.offer()):
            p.grad.copy_(o)  # the round's average of one member: its own offer
    outer.step()
    r.applied()
    r.settle()
    r.inner_step([torch.randn(p.shape, generator=gen) for p in params])
    r.enter_outer()  # a download is about to replace the parameters
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen))  # the swarm's bytes, without this node's round
    r.carry()
    r.inner_step([torch.randn(p.shape, generator=gen) for p in params])
    seen["inner"] = [t.numpy().tobytes() for t in r.inner_parameters()]
    seen["anchor"] = [a.numpy().tobytes() for a in r.anchor]
    seen["feedback"] = [e.numpy().tobytes() for e in r.feedback]
    seen["momentum"] = [t.numpy().tobytes() for p in params for t in momentum_of(outer, p)]
    r.begin()
    seen["params at the round"] = [p.detach().numpy().tobytes() for p in params]
    return seen


def test_a_resident_inner_loop_makes_the_same_bytes_and_crosses_only_at_rounds():
    direct, resident = _lifecycle(False), _lifecycle(True)
    assert direct["params moved by inner updates"] and not resident["params moved by inner updates"]
    for key in ("offer", "inner", "anchor", "feedback", "momentum", "params at the round"):
        assert direct[key] == resident[key], key
