"""The low-comm training loop (node.train.low_comm) of a real node alone in its swarm, in this process: a served step
per outer round, and no bookkeeping per inner update."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dtrain.node import snapshot
from dtrain.node.train import publication
from dtrain.node.config import ConfigError, ModelConfig, NodeConfig, SwarmConfig, TrainConfig
from dtrain.node.data import TokenDataset
from dtrain.node.lowcomm.rounds import InnerRounds
from dtrain.node.swarm.agreement import Download
from dtrain.node.train.trainer import TrainingNode
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until

pytestmark = pytest.mark.unit


def _inner_updates(node: TrainingNode) -> int:
    """The inner AdamW's own count of its updates (every parameter's `step` is the same)."""
    state = node.rounds.inner.state[next(iter(node.model.parameters()))]
    return int(state["step"])


def test_a_lone_node_on_its_own_data_serves_a_step_per_outer_round_and_hashes_nothing_in_between(monkeypatch):
    """A node alone that trains on its own data makes --inner-steps inner updates per served step; its training
    thread computes one digest and one snapshot per served step, none per inner update, and leaves the log's L2
    norm to the publication's own thread."""
    digests, buffers, norms = [], [], []
    real_digest, real_buffer, real_norm = snapshot.digest, snapshot._file_buffer, publication.l2_norm

    def counted_digest(arrays):  # the real digest, noting which thread asked for it
        digests.append(threading.current_thread().name)
        return real_digest(arrays)

    def counted_buffer(nbytes, name):  # the real file buffer of a snapshot's fp32 (or fp16) copy
        buffers.append((threading.current_thread().name, name))
        return real_buffer(nbytes, name)

    def counted_norm(snap):
        norms.append((threading.current_thread().name, snap))
        return real_norm(snap)

    monkeypatch.setattr(publication, "l2_norm", counted_norm)
    monkeypatch.setattr(snapshot, "digest", counted_digest)
    monkeypatch.setattr(snapshot, "_file_buffer", counted_buffer)
    rng = np.random.default_rng(0)
    data = TokenDataset(rng.integers(0, 50257, size=20_000, dtype=np.uint32))
    config = NodeConfig(local_batch_size=2, local_seq_len=16, reference_batch=0,
                        swarm=SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=new_run_id(), inner_steps=3))
    node = TrainingNode(config, ModelConfig.load(TINY_CONFIG), TrainConfig(), dataset=data)
    node.start()
    try:
        wait_until(lambda: node.step >= 4, 60, "three served steps")
        node.publisher.background.wait()
    finally:
        node.stop()
    served = node.snapshot().updates
    inner = _inner_updates(node)
    assert served >= 3
    # each served step is an outer round over at least --inner-steps inner updates (the last round may be unfinished)
    assert inner >= 3 * served
    training = [t for t in digests if t == "dtrain-training"]
    snapshots = [t for t, name in buffers if t == "dtrain-training" and name == "dtrain-snapshot-f32"]
    assert len(training) == served and len(snapshots) == served  # one per served step, not per inner update
    assert len(node.losses()) == served  # one loss per served step: the mean over its inner updates' samples
    assert node.status().applied_samples == 3 * 2 * served  # each served step applied its three batches of 2
    assert norms and all(t.startswith("dtrain-publication") for t, _ in norms)  # none on the training thread
    steps = [snap.step for _, snap in norms]  # the start's step and the served ones, each once at most
    assert len(set(steps)) == len(steps) and set(steps) <= set(range(1, node.step + 1))


def _rounds(min_round_s: float, clock) -> InnerRounds:
    params = [torch.nn.Parameter(torch.zeros(4))]
    return InnerRounds(params, torch.optim.AdamW(params, lr=0.1), inner_steps=2, min_round_s=min_round_s, clock=clock)


def test_a_catch_up_that_fails_leaves_the_node_training_on_and_the_next_one_serves_again(monkeypatch):
    """A catch-up enters the outer round (its pseudo-gradient set aside for the download); one whose download fails
    (a peer gone mid-way) must leave it again: the inner updates go on, the node serves nothing until a catch-up
    agrees with the swarm, and the next one that does serves again."""
    rng = np.random.default_rng(0)
    data = TokenDataset(rng.integers(0, 50257, size=20_000, dtype=np.uint32))
    config = NodeConfig(local_batch_size=2, local_seq_len=16, reference_batch=0,
                        swarm=SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=new_run_id(), inner_steps=3))
    node = TrainingNode(config, ModelConfig.load(TINY_CONFIG), TrainConfig(), dataset=data)
    downloads = []

    def download_that_fails_once() -> Download:  # the first fails mid-way; the next lands on the bytes it holds
        downloads.append(threading.current_thread().name)
        if len(downloads) == 1:
            raise ConnectionResetError("the donor went away mid-download")
        return Download.CHECKED

    node.start()
    try:
        wait_until(lambda: node.step >= 2, 60, "a served step")
        monkeypatch.setattr(node.follower, "_download_to_catch_up", download_that_fails_once)
        node.unverified = True  # the training thread's next turn catches up
        wait_until(lambda: len(downloads) >= 2, 60, "a second catch-up after the failed one")
        step, inner = node.step, _inner_updates(node)
        wait_until(lambda: node.step >= step + 2, 60, "served steps after the failed catch-up")
        assert _inner_updates(node) >= inner + 3 and not node.unverified
        # alone, it arrived late in no epoch: marked so (when its own samples were counted), it never updated again
        assert node.swarm.optimizer.arrived_in is None
    finally:
        node.stop()


def test_a_round_is_due_after_its_inner_steps_and_its_least_duration():
    now = [100.0]
    rounds = _rounds(5.0, lambda: now[0])
    grads = [torch.ones(4)]
    rounds.inner_step(grads)  # the round's first inner update, at 100
    now[0] = 101.0
    rounds.inner_step(grads)
    assert rounds.steps == 2 and not rounds.due  # its inner steps are done, 1 s of its 5
    now[0] = 104.9
    assert not rounds.due
    now[0] = 105.0
    assert rounds.due
    assert _rounds(0.0, lambda: now[0]).due is False  # no inner update yet
    quick = _rounds(0.0, lambda: now[0])
    quick.inner_step(grads)
    quick.inner_step(grads)
    assert quick.due  # no least duration: due after its inner steps


def test_min_round_seconds_defaults_by_device_and_is_bounded():
    assert SwarmConfig().min_round_s is None  # resolved by the node: 0 on a CPU, 15 s on a GPU
    with pytest.raises(ConfigError, match="min_round_s"):
        SwarmConfig(min_round_s=-1.0)
    config = NodeConfig(swarm=SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=new_run_id()))
    node = TrainingNode(config, ModelConfig.load(TINY_CONFIG), TrainConfig())
    assert node._min_round_s() == 0.0  # this machine computes on its CPU
