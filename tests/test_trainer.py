"""TrainingNode in this process, alone in its swarm: a contribution's whole path from `submit` to the served
snapshot, as the spec's single server, with nothing but the node (no bridge, no subprocess)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dtrain.node.config import ModelConfig, NodeConfig, SwarmConfig, TrainConfig
from dtrain.node.contribution import Contribution, Section
from dtrain.node.train.pool import StepMismatch
from dtrain.node.snapshot import params_digest
from dtrain.node.train.trainer import TrainingNode
from tests.adamw import gpt2_adamw
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until

pytestmark = pytest.mark.unit

TRAIN = TrainConfig(min_nodes_for_update=2)


@pytest.fixture(scope="module", params=["low-comm", "low-comm resident", "per-step"])
def node(request):
    """A node alone that only contributors train is the spec's single server in either sync mode (low-comm, the
    default: each inner update is an update), and so is a low-comm node whose inner loop trains its own copy of the
    model (on a GPU, the device's; here a second copy on the CPU, through the same code)."""
    sync, _, resident = request.param.partition(" ")
    config = NodeConfig(swarm=SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=new_run_id(), sync=sync))
    node = TrainingNode(config, ModelConfig.load(TINY_CONFIG), TRAIN, resident=bool(resident))
    node.start()
    try:
        yield node
    finally:
        node.stop()


def _gradient(node, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=0.01, size=t.elements).astype(np.float32) for t in node.tensors]


def _dense(contributor: str, step: int, samples: int, loss: float, grads) -> Contribution:
    return Contribution(contributor, step, samples, loss, tuple(Section(i, None, g) for i, g in enumerate(grads)))


def test_two_contributors_make_one_exact_adamw_update(node):  # first: it needs the node's seeded step 1
    reference = copy.deepcopy(node.model)
    assert node.step == 1 and node.snapshot().digest == params_digest(reference)
    g1, g2 = _gradient(node, 1), _gradient(node, 2)
    assert node.submit(_dense("a", 1, 3, 2.0, g1)) == 1
    assert node.status().pending_contributors == 1 and node.step == 1  # min_nodes_for_update is 2
    node.submit(_dense("b", 1, 1, 6.0, g2))
    wait_until(lambda: node.step == 2, 30, "the update")

    params = list(reference.parameters())
    opt = gpt2_adamw(params, [q.shape for q in params], lr=TRAIN.learning_rate, betas=(TRAIN.beta1, TRAIN.beta2),
                     eps=TRAIN.eps, weight_decay=TRAIN.weight_decay)
    for p, a, b in zip(reference.parameters(), g1, g2):
        p.grad = ((torch.from_numpy(a) * 3 + torch.from_numpy(b) * 1) / 4).view_as(p)
    opt.step()
    snap = node.snapshot()
    assert snap.digest == params_digest(reference)  # exactly the samples-weighted mean, one AdamW step
    assert node.losses() == [pytest.approx((3 * 2.0 + 1 * 6.0) / 4)]
    status = node.status()
    assert (status.accepted_packets, status.applied_packets, status.carried_packets) == (2, 2, 0)
    assert (status.accepted_samples, status.applied_samples, status.pending_samples) == (4, 4, 0)
    assert status.step == 2 and status.params_sha256 == snap.digest and status.peers == 1
    if node.low_comm:
        # between updates its gradient buffers hold nothing (zeros, no page) and the anchor is the served bytes
        served = [a.ctypes.data for a in snap.f32]
        wait_until(lambda: [a.data_ptr() for a in node.rounds.anchor] == served, 10, "the anchor on the snapshot")
        assert all(p.grad.is_shared() and not p.grad.any() for p in node.model.parameters())


def test_a_stale_contribution_changes_nothing(node):
    step, before = node.step, node.status()
    with pytest.raises(StepMismatch) as e:
        node.submit(_dense("a", step + 1, 1, 1.0, _gradient(node, 3)))
    assert e.value.server_step == step
    after = node.status()
    assert (after.accepted_packets, after.pending_contributors) == (before.accepted_packets, before.pending_contributors)


def _lone_low_comm(checkpoint_dir, **swarm) -> TrainingNode:
    config = NodeConfig(checkpoint_dir=str(checkpoint_dir),
                        swarm=SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=new_run_id(), **swarm))
    return TrainingNode(config, ModelConfig.load(TINY_CONFIG), TrainConfig(min_nodes_for_update=1))


def test_a_restarted_low_comm_node_goes_on_bit_for_bit_and_a_checkpoint_that_does_not_fit_is_refused(tmp_path):
    """A lone low-comm node stopped after two updates and restarted from its checkpoint makes the same two next
    updates as one that never stopped: the spec's single server's four AdamW steps, moments included (its inner
    AdamW's state is in the checkpoint). A node that cannot take the checkpoint whole takes none of it."""
    first = _lone_low_comm(tmp_path)
    first.start()
    seeded = copy.deepcopy(first.model)
    grads = [_gradient(first, seed) for seed in (11, 12, 13, 14)]
    try:
        for step, g in enumerate(grads[:2], start=1):
            first.submit(_dense("a", step, 2, 3.0, g))
            wait_until(lambda: first.step == step + 1, 30, f"update {step}")
    finally:
        first.stop()
    assert not first.is_alive()

    for swarm, why in [(dict(sync="per-step"), "written by a low-comm node"),
                       (dict(wire_codec="fp16"), "error feedback")]:
        refused = _lone_low_comm(tmp_path, **swarm)
        with pytest.raises(ValueError, match=why):
            refused.start()
        assert params_digest(refused.model) == params_digest(seeded) and refused.swarm is None  # nothing applied

    second = _lone_low_comm(tmp_path)
    second.start()
    try:
        assert second.step == 3 and second.losses() == [3.0, 3.0]
        for step, g in enumerate(grads[2:], start=3):
            second.submit(_dense("a", step, 2, 3.0, g))
            wait_until(lambda: second.step == step + 1, 30, f"update {step}")
        served = second.snapshot().digest
    finally:
        second.stop()

    params = list(seeded.parameters())
    opt = gpt2_adamw(params, [q.shape for q in params], lr=TRAIN.learning_rate, betas=(TRAIN.beta1, TRAIN.beta2),
                     eps=TRAIN.eps, weight_decay=TRAIN.weight_decay)
    for g in grads:
        for p, a in zip(params, g):
            p.grad = torch.from_numpy(a).view_as(p).clone()
        opt.step()
    assert served == params_digest(seeded)  # as if it had never stopped
