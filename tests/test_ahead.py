"""Local batches trained while an outer round runs (node.train.ahead): what they hold, and that nothing writes the
parameters while one of their passes reads them."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dtrain.node.config import ModelConfig
from dtrain.node.lowcomm.outer import OuterNesterov
from dtrain.node.lowcomm.rounds import InnerRounds
from dtrain.node.model import build_model
from dtrain.node.data import TokenDataset
from dtrain.node.train.ahead import Ahead
from dtrain.node.train.compute import Batch, Compute, OwnBatches
from tests.nodeproc import TINY_CONFIG, wait_until

pytestmark = pytest.mark.unit

BATCH, SEQ = 2, 16


@pytest.fixture
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig.load(TINY_CONFIG))


def passes(model, seed: int = 0):
    """The node's own batches (a real pass of the model per call): the same ones for every caller with the same
    seed."""
    rng = np.random.default_rng(seed)
    data = TokenDataset(rng.integers(0, 50257, size=20_000, dtype=np.uint32))
    return OwnBatches(Compute(model), data, BATCH, SEQ, np.random.default_rng(seed)).next


def test_the_passes_of_a_round_sum_what_the_same_batches_sum_one_after_the_other(model):
    ahead = Ahead(passes(model), allowance=3 * BATCH)
    assert ahead.start()
    wait_until(lambda: ahead.held_samples >= 3 * BATCH, 60, "three passes")
    assert not ahead.start()  # already running
    ahead.stop()
    assert not ahead.start()  # the allowance is full until the batch is taken
    batch = ahead.take()
    assert (batch.samples, ahead.samples_total, ahead.held_samples) == (3 * BATCH, 3 * BATCH, 0)

    serial = passes(model)
    first = serial()
    expected, losses = list(first.sums), [float(first.loss.detach())]
    for _ in range(2):
        b = serial()
        torch._foreach_add_(expected, list(b.sums))
        losses.append(float(b.loss.detach()))
    for got, want in zip(batch.sums, expected):
        assert torch.equal(got, want)
    assert float(batch.loss) == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert ahead.take() is None


def test_no_pass_starts_once_stopped_and_nothing_is_taken_while_they_run(model):
    release, started = threading.Event(), threading.Event()
    one = passes(model)

    def held() -> Batch:
        started.set()
        release.wait(30)
        return one()
    ahead = Ahead(held, allowance=100 * BATCH)
    ahead.start()
    assert started.wait(30)
    with pytest.raises(RuntimeError):
        ahead.take()
    threading.Timer(0.3, release.set).start()
    ahead.stop()  # waits for the pass in flight, and starts none after it
    assert ahead.take().samples == BATCH
    with pytest.raises(ValueError):
        Ahead(one, allowance=0)


def test_a_pass_that_fails_adds_nothing_and_is_kept_for_the_training_thread(model):
    def failing() -> Batch:
        raise MemoryError("no room for the activations")
    ahead = Ahead(failing, allowance=BATCH)
    ahead.start()
    wait_until(lambda: ahead.error is not None, 30, "the failed pass")
    ahead.stop()
    assert isinstance(ahead.error, MemoryError) and ahead.take() is None


@pytest.mark.parametrize("writer", ["download", "outer step"])
def test_the_round_writes_the_parameters_only_after_the_pass_in_flight(model, writer):
    """The round's writers (a download's set-aside, the outer step) wait for the pass that reads the parameters:
    the pass ends first, the parameters move after, and no pass starts once they may."""
    params = list(model.parameters())
    ahead_events: list[str] = []
    release, started = threading.Event(), threading.Event()
    one = passes(model)

    def held() -> Batch:
        started.set()
        release.wait(30)
        batch = one()
        ahead_events.append("pass done")
        return batch
    ahead = Ahead(held, allowance=100 * BATCH)
    rounds = InnerRounds(params, torch.optim.AdamW(params, lr=1e-3), 1, before_write=ahead.stop)
    rounds.inner_step([torch.full_like(p, 0.01) for p in params])  # the parameters leave the anchor
    source = rounds.begin()
    outer = OuterNesterov(params, lr=0.7, momentum=0.9)
    outer.source = source
    for p in params:
        p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for p in params]
    ahead.start()
    assert started.wait(30)

    def write() -> None:
        if writer == "download":
            rounds.enter_outer()  # the parameters back at the anchor, before a download replaces them
        else:
            outer.step()  # from the anchor, by the round's average in .grad
        ahead_events.append("parameters written")
    thread = threading.Thread(target=write)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive() and ahead_events == []  # the writer waits for the pass
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    release.set()
    thread.join(30)
    assert ahead_events == ["pass done", "parameters written"]
    assert not all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert not ahead.running and ahead.take().samples == BATCH
