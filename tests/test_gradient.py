"""PendingGradient: exact samples-weighted sums, the .grad convention hivemind's accumulator needs, and carrying."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.node.contribution import Contribution, Section
from dtrain.node.train.gradient import PendingGradient

pytestmark = pytest.mark.unit

ELEMENTS = (6, 4)


def _contribution(samples: int, loss: float, dense: np.ndarray, idx, vals) -> Contribution:
    return Contribution("c", 1, samples, loss, (
        Section(0, None, dense.astype(np.float32)),
        Section(1, np.asarray(idx, np.int64), np.asarray(vals, np.float32)),  # Mode 1: repeats add up
    ))


def test_contributions_are_weighted_by_samples():
    g = PendingGradient(ELEMENTS)
    g.add_contributions([
        _contribution(2, 3.0, np.arange(6), [0, 0, 3], [1.0, 2.0, -1.0]),
        _contribution(6, 1.0, np.ones(6), [2], [0.5]),
    ])
    assert (g.samples, g.packets) == (8, 2)
    assert torch.equal(g.sums[0], torch.tensor(2 * np.arange(6) + 6 * np.ones(6), dtype=torch.float32))
    assert torch.equal(g.sums[1], torch.tensor([6.0, 0.0, 3.0, -2.0]))
    mean = g.mean()
    assert torch.allclose(mean[1], torch.tensor([0.75, 0.0, 0.375, -0.25]))
    applied = g.settle()
    assert (applied.samples, applied.packets) == (8, 2)
    assert applied.mean_loss == (2 * 3.0 + 6 * 1.0) / 8


def test_write_grads_scales_by_calls_over_samples():
    g = PendingGradient(ELEMENTS)
    g.add([torch.full((6,), 4.0), torch.full((4,), -8.0)], samples=4, loss_sum=0.0)
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    for p in params:
        p.grad = torch.zeros_like(p)
    g.write_grads(params, calls=3)
    assert torch.equal(params[0].grad, torch.full((2, 3), 3.0))  # 4 * 3 / 4
    assert torch.equal(params[1].grad, torch.full((4,), -6.0))


def test_carry_keeps_everything_and_counts_once():
    g = PendingGradient(ELEMENTS)
    g.add_contributions([_contribution(3, 2.0, np.ones(6), [1], [1.0])])
    before = [s.clone() for s in g.sums]
    g.carry()
    g.carry()  # missing two updates counts its samples once
    assert all(torch.equal(a, b) for a, b in zip(before, g.sums))
    g.add_contributions([_contribution(1, 2.0, np.ones(6), [1], [1.0])])
    counters = g.counters()
    assert (counters.carried_samples, counters.carried_packets, counters.pending_samples) == (3, 1, 4)
    g.settle()
    counters = g.counters()
    assert (counters.applied_samples, counters.applied_packets, counters.pending_samples) == (4, 2, 0)
    assert all(not s.any() for s in g.sums)


def test_local_allowance_starts_again_after_a_missed_update():
    g = PendingGradient(ELEMENTS)
    g.add([torch.ones(6), torch.ones(4)], samples=4, loss_sum=4.0, local=True)
    assert g.local_samples == 4
    g.carry()
    assert g.local_samples == 0 and g.samples == 4


def test_low_comms_local_allowance_starts_again_at_each_inner_update():
    g = PendingGradient(ELEMENTS)
    g.add([torch.ones(6), torch.ones(4)], samples=2, loss_sum=2.0, local=True)
    assert g.undrained_local_samples == 2
    g.drain()  # an inner update: the samples stay pending for the outer round, the allowance starts again
    assert g.undrained_local_samples == 0 and g.local_samples == 2 and g.samples == 2
    g.add([torch.ones(6), torch.ones(4)], samples=1, loss_sum=1.0, local=True)
    g.add([torch.ones(6), torch.ones(4)], samples=3, loss_sum=3.0)  # a hand-over: not the node's own data
    assert g.undrained_local_samples == 1
    g.carry()
    assert g.undrained_local_samples == 0
    g.add([torch.ones(6), torch.ones(4)], samples=1, loss_sum=1.0, local=True)
    g.settle()
    assert g.undrained_local_samples == 0 and g.local_samples == 0


def test_an_adopted_gradient_becomes_the_empty_sums_with_the_bytes_of_zeros_plus_it():
    grads = [torch.tensor([-0.0, 1.5, -2.0]), torch.tensor([[0.25, -0.0]])]
    expected = PendingGradient([3, 2])
    expected.add([g.clone() for g in grads], 2, 1.0, local=True)
    g = PendingGradient([3, 2])
    first = grads[0].data_ptr()
    g.add(grads, 2, 1.0, local=True, adopt=True)
    assert g.sums[0].data_ptr() == first  # taken, not copied
    for mine, theirs in zip(g.sums, expected.sums):
        assert mine.numpy().tobytes() == theirs.numpy().tobytes()  # -0.0 + 0.0 is 0.0, as zeros + -0.0 is
    more = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([[1.0, 1.0]])]
    g.add(more, 1, 0.5, adopt=True)  # the sums hold something: added, never replaced
    expected.add(more, 1, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(g.sums, expected.sums))
    assert (g.samples, g.local_samples) == (3, 2)
    g.drain()
    fresh = [torch.tensor([2.0, 0.0, 0.0]), torch.tensor([[0.0, 3.0]])]
    g.add(fresh, 1, 0.0, adopt=True)  # empty again after a drain: taken again
    assert g.sums[1].data_ptr() == fresh[1].data_ptr()


def test_losses_left_as_tensors_count_in_the_order_they_came_with_the_bytes_floats_would_give():
    # float64 sums depend on their order: 1 + 1 + 2**53 + 1 is 2**53 + 4, 2**53 + 1 + 1 + 1 is 2**53
    parts = [torch.ones(6), torch.ones(4)]
    packet = _contribution(1, float(2 ** 53), np.ones(6), [1], [1.0])
    as_floats, as_tensors = PendingGradient(ELEMENTS), PendingGradient(ELEMENTS)
    for g, deferred in ((as_floats, False), (as_tensors, True)):
        for _ in range(2):
            g.add(parts, 1, 0.0, local=True, loss=torch.tensor(1.0)) if deferred else g.add(parts, 1, 1.0, local=True)
        g.add_contributions([packet])
        g.add(parts, 1, 0.0, local=True, loss=torch.tensor(1.0)) if deferred else g.add(parts, 1, 1.0, local=True)
    assert as_floats.loss_sum == 2.0 ** 53 + 4
    assert as_tensors.loss_sum == as_floats.loss_sum  # the same float64 sum, term by term
    assert as_tensors.settle().mean_loss == as_floats.settle().mean_loss
    assert as_tensors.loss_sum == 0.0


def test_sums_taken_by_a_drain_are_not_replaced_by_zeros_until_something_reads_them():
    g = PendingGradient(ELEMENTS)
    g.add([torch.ones(6), torch.ones(4)], 2, 1.0)
    taken = g.drain()
    assert g._sums is None  # no zeros made (a launch per tensor on a GPU) that the next batch's gradient replaces
    assert [t.tolist() for t in taken] == [[0.5] * 6, [0.5] * 4]
    assert all(not s.any() for s in g.sums) and [s.numel() for s in g.sums] == list(ELEMENTS)
    g.settle()
    assert g._sums is None and g.mean()[0].tolist() == [0.0] * 6
