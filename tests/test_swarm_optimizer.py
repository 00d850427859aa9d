"""SwarmOptimizer on a real hivemind DHT: the update it applies is one exact AdamW step on the node's gradient,
also when hivemind has no average to offer (one peer, several step() calls; or a gradient round that failed)."""
from __future__ import annotations

import copy
import time

import pytest
import torch

from dtrain.node.swarm import swarm
from dtrain.node.train.adamw import make_local_optimizer
from dtrain.node.config import ModelConfig, SwarmConfig, TrainConfig
from dtrain.node.model import build_model
from tests.adamw import gpt2_adamw
from tests.nodeproc import TINY_CONFIG, new_run_id

pytestmark = pytest.mark.swarm

TRAIN = TrainConfig()


@pytest.fixture
def single_peer():
    model = build_model(ModelConfig.load(TINY_CONFIG))
    reference = copy.deepcopy(model)
    config = SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=new_run_id(), target_batch_size=6,
                         matchmaking_time_s=1.0, request_timeout_s=0.5, averaging_timeout_s=5.0)
    local_gradients = []  # the node's exact gradient, set by each test
    handle = swarm.Swarm(config, make_local_optimizer(model, TRAIN), local_gradients=lambda: local_gradients)
    try:
        yield model, reference, handle.optimizer, local_gradients
    finally:
        handle.shutdown()


def _gradient(model) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(p.shape, generator=gen) * 0.01 for p in model.parameters()]


def _reference_step(reference, grads):
    """One plain torch AdamW step from the same start: what the swarm's update must be."""
    params = list(reference.parameters())
    opt = gpt2_adamw(params, [q.shape for q in params], lr=TRAIN.learning_rate, betas=(TRAIN.beta1, TRAIN.beta2),
                     eps=TRAIN.eps, weight_decay=TRAIN.weight_decay)
    for p, g in zip(reference.parameters(), grads):
        p.grad = g.clone()
    opt.step()
    return opt


def _assert_same_update(model, opt, reference, ref_opt):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"{name} differs from one AdamW step"
    local = opt.state_averager.optimizer
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(local.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])
        assert torch.equal(local.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])


def test_one_peer_several_calls_apply_the_mean_gradient(single_peer):
    model, reference, opt, local_gradients = single_peer
    grads = _gradient(model)
    local_gradients[:] = grads
    # the node's convention: before the k-th call of an epoch, .grad holds k * the mean gradient so far
    for calls in (1, 2, 3):
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p.grad.copy_(g * calls)
        opt.step(batch_size=2)
    assert opt.local_epoch == 1
    _assert_same_update(model, opt, reference, _reference_step(reference, grads))


def test_failed_gradient_round_applies_the_local_gradient(single_peer):
    model, reference, opt, local_gradients = single_peer
    grads = _gradient(model)
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.grad.copy_(g)
    opt.grad_averager.accumulate_grads_(batch_size=6)
    # a gradient round that begins loads hivemind's accumulators (the .grad buffers) into the tensors it averages
    # (the same ones) and resets its counters; a round that then fails halfway has written some of its average
    # there, and hivemind falls back to "local gradients"
    opt.grad_averager.load_accumulators_into_averager_()
    opt.grad_averager.reset_accumulated_grads_()
    with opt.grad_averager.get_tensors() as averaged:
        for t in averaged[::2]:
            t.mul_(0.5).add_(1.0)
    assert not all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    local_gradients[:] = grads
    opt._load_local_gradients_into_optimizer()
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


def _second_peer(opt_a, averaging=swarm.Averaging(), **config):
    """A second peer of `opt_a`'s swarm, as the single peer's but joining it (`config`: SwarmConfig's other
    values; `averaging`: how its rounds average): its model, its Swarm (to shut down) and the list its exact
    gradient is read from."""
    model = build_model(ModelConfig.load(TINY_CONFIG))
    config = SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=tuple(opt_a.dht.get_visible_maddrs()),
                         run_id=opt_a.run_id, target_batch_size=6, matchmaking_time_s=1.0, request_timeout_s=0.5,
                         averaging_timeout_s=5.0, **config)
    grads = []
    return model, swarm.Swarm(config, make_local_optimizer(model, TRAIN), local_gradients=lambda: grads,
                              averaging=averaging), grads


def test_a_peer_behind_the_swarm_does_not_update_until_it_caught_up(single_peer):
    """hivemind lets a peer one epoch behind update anyway, joining the others' next gradient round with a gradient
    of parameters they have left; its gradient was then applied in their update and carried into a later one too."""
    model_a, _, opt_a, grads_a = single_peer
    model_b, peer_b, grads_b = _second_peer(opt_a)
    try:
        opt_b = peer_b.optimizer
        # as a node does when it joins: with no look at the swarm yet, hivemind's first step() would check for an
        # exact epoch match later and download the state instead
        assert peer_b.wait_for_progress(timeout_s=10)
        grads_a[:] = grads_b[:] = _gradient(model_a)
        for model, grads in ((model_a, grads_a), (model_b, grads_b)):
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p.grad.copy_(g)
        opt_b.step(batch_size=2)  # B accumulates toward the target of epoch 0 ...
        opt_a.step(batch_size=6)  # ... and A reaches it and updates without B (B is not gathering a round)
        assert opt_a.local_epoch == 1
        deadline = time.monotonic() + 10
        while opt_b.tracker.global_epoch < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert opt_b.tracker.global_epoch == 1
        before = [p.detach().clone() for p in model_b.parameters()]
        opt_b.step(batch_size=4)
        assert opt_b.local_epoch == 0 and opt_b.last_round is None
        assert all(torch.equal(p, q) for p, q in zip(model_b.parameters(), before))
    finally:
        peer_b.shutdown()


def test_a_client_mode_peer_whose_round_fails_makes_no_update(single_peer):
    """A client-mode peer (behind NAT: nobody can download its state) that updated alone after a failed round
    would serve bytes for the next epoch that no other peer has, its packets applied on itself only. It makes no
    update: same epoch, same parameters, its gradient still to be averaged in a later round."""
    model_a, _, opt_a, _ = single_peer
    model_c, peer_c, grads_c = _second_peer(opt_a, reachability="client")
    try:
        opt_c = peer_c.optimizer
        assert peer_c.client_mode and opt_c.client_mode and peer_c.reachability.chosen_by == "flag"
        assert peer_c.wait_for_progress(timeout_s=10)
        grads_c[:] = _gradient(model_c)
        with torch.no_grad():
            for p, g in zip(model_c.parameters(), grads_c):
                p.grad.copy_(g)
        before = [p.detach().clone() for p in model_c.parameters()]
        deadline = time.monotonic() + 30
        while opt_c.skipped_rounds == 0 and time.monotonic() < deadline:
            # the target reached, C gathers a round; A (public, the only one that could lead it) is not averaging
            opt_c.step(batch_size=6 if opt_c.grad_averager.local_samples_accumulated == 0 else 0)
        assert opt_c.skipped_rounds >= 1
        assert opt_c.local_epoch == 0 and opt_c.last_round is None
        assert all(torch.equal(p, q) for p, q in zip(model_c.parameters(), before))
        assert opt_a.local_epoch == 0
    finally:
        peer_c.shutdown()


def test_a_peer_whose_round_fails_in_the_epoch_it_arrived_in_late_makes_no_update(single_peer):
    """A node that arrived late into an epoch (after a download or a replay) whose round misses the others' makes
    no update of its own there: theirs is the swarm's, and its own would be bytes they do not have (it would then
    download the whole state). In any other epoch its failed round is an update on its own gradient, as before."""
    model_a, _, opt_a, _ = single_peer
    model_b, peer_b, grads_b = _second_peer(opt_a)
    try:
        opt_b = peer_b.optimizer
        assert peer_b.wait_for_progress(timeout_s=10)
        grads_b[:] = _gradient(model_b)
        with torch.no_grad():
            for p, g in zip(model_b.parameters(), grads_b):
                p.grad.copy_(g)
        with torch.no_grad():
            for p, g in zip(model_a.parameters(), grads_b):
                p.grad.copy_(g)
        opt_a.step(batch_size=2)  # A's progress: B counts A, which never joins B's rounds
        assert opt_a.local_epoch == 0
        before = [p.detach().clone() for p in model_b.parameters()]
        opt_b.arrived_in = 0

        def fail_rounds(until) -> None:  # B reaches the target and gathers a round that A, not averaging, misses
            deadline = time.monotonic() + 30
            while not until() and time.monotonic() < deadline:
                opt_b.step(batch_size=6 if opt_b.grad_averager.local_samples_accumulated == 0 else 0)

        fail_rounds(lambda: opt_b.skipped_rounds >= 1)
        assert opt_b.skipped_rounds >= 1 and opt_b.local_epoch == 0 and opt_b.last_round is None
        assert all(torch.equal(p, q) for p, q in zip(model_b.parameters(), before))
        opt_b.arrived_in = None  # the rule, and nothing else, kept B from updating alone
        fail_rounds(lambda: opt_b.local_epoch == 1)
        assert opt_b.local_epoch == 1 and opt_b.last_round.group == (opt_b.peer_id,)
        assert not all(torch.equal(p, q) for p, q in zip(model_b.parameters(), before))
        assert opt_a.local_epoch == 0
    finally:
        peer_b.shutdown()


def test_a_peer_that_carries_failed_rounds_updates_alone_only_after_that_many_in_a_row(single_peer):
    """Low-comm's rule: a round that failed while others train makes no update (every member failed it, and updates
    of their own would each need the agreement's download but one); the gradient waits for the next round. After
    `failed_rounds_carried` failures in a row the peer updates alone, so a round that keeps failing cannot stall it."""
    model_a, _, opt_a, _ = single_peer
    model_b, peer_b, grads_b = _second_peer(opt_a, averaging=swarm.Averaging(failed_rounds_carried=2))
    try:
        opt_b = peer_b.optimizer
        assert peer_b.wait_for_progress(timeout_s=10)
        grads_b[:] = _gradient(model_b)
        for model in (model_a, model_b):
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads_b):
                    p.grad.copy_(g)
        opt_a.step(batch_size=2)  # A's progress: B counts A, which never joins B's rounds
        assert opt_a.local_epoch == 0
        opt_b.report_samples(4)  # with A's, the target: B's next step begins a round
        deadline = time.monotonic() + 10
        while opt_b.tracker.global_progress.num_peers < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert opt_b.tracker.global_progress.num_peers == 2  # B's rounds fail while another peer trains
        before = [p.detach().clone() for p in model_b.parameters()]
        seen = []  # (failed rounds so far, B's epoch) after each round B gathered

        deadline = time.monotonic() + 60
        while opt_b.local_epoch == 0 and time.monotonic() < deadline:
            skipped = opt_b.skipped_rounds
            opt_b.step(batch_size=6 if opt_b.grad_averager.local_samples_accumulated == 0 else 0)
            if opt_b.skipped_rounds != skipped or opt_b.local_epoch != 0:
                seen.append((opt_b.skipped_rounds, opt_b.local_epoch))
                if opt_b.local_epoch == 0:  # no update: same parameters, the gradient still pending
                    assert all(torch.equal(p, q) for p, q in zip(model_b.parameters(), before))
        assert seen == [(1, 0), (2, 0), (2, 1)], seen
        assert opt_b.last_round.group == (opt_b.peer_id,)
        assert not all(torch.equal(p, q) for p, q in zip(model_b.parameters(), before))
        assert opt_a.local_epoch == 0
    finally:
        peer_b.shutdown()


def test_a_state_handed_to_a_download_is_one_moments_copy(single_peer):
    """What the state averager streams to a downloading peer does not change when the node trains on during the
    download (hivemind would stream views of the live tensors, serialized when the stream reaches each one)."""
    model, _, opt, _ = single_peer
    metadata, tensors, _ = opt.state_averager.get_current_state()
    params = list(model.parameters())
    moments = [v for state in opt.state_averager.optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0]
    assert len(tensors) >= len(params) and moments
    before = [t.clone() for t in tensors]
    with torch.no_grad():
        for t in params + moments:
            t.add_(1.0)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    assert not torch.equal(tensors[0], params[0])  # the node's own tensors did move
