"""SwarmOptimizer on a real hivemind DHT: the update it applies is one exact AdamW step on the node's gradient,
also when hivemind has no average to offer (one peer, several step() calls; or a gradient round that failed)."""
from __future__ import annotations

import copy

import pytest
import torch

from node import swarm
from node.config import ModelConfig, SwarmConfig, TrainConfig
from node.model import build_model
from tests.nodeproc import TINY_CONFIG, new_run_id

TRAIN = TrainConfig()


@pytest.fixture
def single_peer():
    model = build_model(ModelConfig.load(TINY_CONFIG))
    reference = copy.deepcopy(model)
    config = SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=new_run_id(), target_batch_size=6,
                         matchmaking_time_s=1.0, request_timeout_s=0.5, averaging_timeout_s=5.0)
    local_gradients = []  # the node's exact gradient, set by each test
    handle = swarm.Swarm(config, swarm.make_local_optimizer(model, TRAIN), local_gradients=lambda: local_gradients)
    try:
        yield model, reference, handle.optimizer, local_gradients
    finally:
        handle.shutdown()


def _gradient(model) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(p.shape, generator=gen) * 0.01 for p in model.parameters()]


def _reference_step(reference, grads):
    """One plain torch AdamW step from the same start: what the swarm's update must be."""
    opt = torch.optim.AdamW(reference.parameters(), lr=TRAIN.learning_rate, betas=(TRAIN.beta1, TRAIN.beta2),
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
    # a gradient round that begins resets hivemind's accumulators (the .grad buffers) before it runs; when it
    # then fails, hivemind falls back to "local gradients"
    opt.grad_averager.reset_accumulated_grads_()
    assert all(not p.grad.any() for p in model.parameters())
    local_gradients[:] = grads
    opt._load_local_gradients_into_optimizer()
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
