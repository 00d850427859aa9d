"""Local batches trained while an outer round runs (node.train.ahead): what they hold, and that nothing writes the
parameters while one of their passes reads them."""
from __future__ import annotations

import copy
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


def _resident(model, inner_steps: int = 3, allowance: int = 2 * BATCH, pass_of=None):
    """A resident inner loop as the node builds one (on a GPU, the device's copy; here a second copy on the CPU,
    through the same code): the rounds over the model's parameters, the inner AdamW over the copy, and the passes
    during a round making inner updates of the copy."""
    compute = Compute(model)
    replica = compute.resident()
    params, trained = list(model.parameters()), list(replica.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)  # hivemind's gradient buffers
    rng = np.random.default_rng(0)
    data = TokenDataset(rng.integers(0, 50257, size=20_000, dtype=np.uint32))
    own = OwnBatches(compute, data, BATCH, SEQ, np.random.default_rng(0)).next
    ahead = Ahead(pass_of(own) if pass_of else own, allowance=allowance,
                  step=lambda grads: rounds.step_in_round(grads), max_steps=inner_steps)
    rounds = InnerRounds(params, torch.optim.AdamW(trained, lr=1e-3), inner_steps, trained=trained,
                         before_write=ahead.stop)
    return rounds, ahead, replica


def _bytes(tensors) -> list[bytes]:
    return [t.detach().numpy().tobytes() for t in tensors]


def test_a_resident_loop_goes_on_with_inner_updates_during_the_round_and_lands_them_on_its_result(model):
    rounds, ahead, replica = _resident(model)
    params, trained = rounds.params, rounds.trained
    reference = copy.deepcopy(replica)  # the same copy and AdamW, stepped one update after the other
    ref_opt = torch.optim.AdamW(list(reference.parameters()), lr=1e-3)
    rounds.inner_step([torch.full_like(p, 0.01) for p in trained])
    ref_opt.load_state_dict(copy.deepcopy(rounds.inner.state_dict()))  # its own moments, not views of the same
    with torch.no_grad():
        for r, t in zip(reference.parameters(), trained):
            r.copy_(t)
    outer = OuterNesterov(params, lr=0.7, momentum=0.9)
    outer.source = rounds.begin()  # the parameters take the copy's values
    at_begin = [p.detach().clone() for p in params]
    assert ahead.start()
    wait_until(lambda: ahead.steps == 3, 60, "three inner updates during the round")
    assert _bytes(params) == _bytes(at_begin)  # the round's parameters: nothing but the round writes them

    rng = np.random.default_rng(0)
    data = TokenDataset(rng.integers(0, 50257, size=20_000, dtype=np.uint32))
    serial = OwnBatches(Compute(reference), data, BATCH, SEQ, np.random.default_rng(0)).next
    losses = []
    for _ in range(3):
        a, b = serial(), serial()
        sums = list(a.sums)
        torch._foreach_add_(sums, list(b.sums))
        torch._foreach_div_(sums, 2 * BATCH)
        losses += [float(a.loss.detach()), float(b.loss.detach())]
        for r, g in zip(reference.parameters(), sums):
            r.grad = g
        ref_opt.step()
    moved = [t.detach().clone() for t in trained]
    assert _bytes(moved) == _bytes(reference.parameters())

    for p in params:  # the round's average in .grad: the outer step moves the parameters from the anchor
        p.grad = torch.full_like(p, 0.003)
    outer.step()
    ahead.stop()
    rounds.applied()
    rounds.settle()  # the outer update applied this node's offer: its result is the next anchor
    assert not _bytes(params) == _bytes(at_begin)
    assert _bytes(trained) == _bytes((m - b) + p.detach() for m, b, p in zip(moved, at_begin, params))
    assert rounds.steps == 3 and not rounds.in_outer
    samples, loss = ahead.take_trained()
    assert samples == 6 * BATCH and float(loss) == pytest.approx(sum(losses) / 6, rel=1e-6)
    assert ahead.take_trained() == (0, None) and ahead.take() is None
    # the next round is due after --inner-steps updates between rounds: those made during this one do not count
    assert not rounds.due
    for _ in range(3):
        rounds.inner_step([torch.full_like(p, 0.001) for p in trained])
    assert rounds.due and rounds.steps == 6
    # it begins from the copy: the parameters take every update made since this round's
    rounds.begin()
    assert _bytes(params) == _bytes(trained)


def test_a_round_that_replaced_nothing_leaves_a_resident_copy_exactly_where_its_updates_took_it(model):
    rounds, ahead, _ = _resident(model, inner_steps=1, allowance=BATCH)
    rounds.inner_step([torch.full_like(p, 0.01) for p in rounds.trained])
    rounds.begin()
    ahead.start(max_steps=2)  # as many as the round holds, here more than --inner-steps
    wait_until(lambda: ahead.steps == 2, 60, "two inner updates during the round")
    time.sleep(0.3)
    assert ahead.steps == 2  # and no more
    ahead.stop()
    moved = _bytes(rounds.trained)
    rounds.carry()  # the round failed and nothing replaced the parameters: no update at all
    assert _bytes(rounds.trained) == moved and rounds.steps == 1 + 2
    with pytest.raises(RuntimeError):
        rounds.step_in_round([torch.zeros_like(p) for p in rounds.trained])  # outside a round


def test_a_resident_loops_passes_do_not_hold_up_the_outer_step_and_the_round_end_waits_for_them(model):
    """The outer step writes the parameters, which a resident loop's passes do not read: it goes on while a pass
    runs. The round's end writes the device's copy: it waits for the pass in flight."""
    release, started = threading.Event(), threading.Event()

    def held(one):
        def run() -> Batch:
            started.set()
            release.wait(30)
            return one()
        return run
    rounds, ahead, _ = _resident(model, inner_steps=5, allowance=BATCH, pass_of=held)
    rounds.inner_step([torch.full_like(p, 0.01) for p in rounds.trained])
    outer = OuterNesterov(rounds.params, lr=0.7, momentum=0.9)
    outer.source = rounds.begin()
    for p in rounds.params:
        p.grad = torch.full_like(p, 0.003)
    ahead.start()
    assert started.wait(30)
    outer.step()  # not held by the pass in flight
    assert ahead.running and ahead.steps == 0
    rounds.applied()
    settle = threading.Thread(target=rounds.settle)
    settle.start()
    time.sleep(0.5)
    assert settle.is_alive()  # the round's end waits for the pass
    release.set()
    settle.join(30)
    assert not settle.is_alive() and not ahead.running
    assert ahead.steps == 1 and rounds.steps == 1  # the next round's: the update made during this one
