"""Robust aggregation: exact for honest hand-overs, order-free, and each attack docs/robustness.md lists bounded."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dtrain.node.train import robust, robust_stats
from dtrain.node.contribution import Contribution, Section, add_sections
from dtrain.node.train.robust import Aggregate, NormTracker, RobustConfig, RobustConfigError

pytestmark = pytest.mark.unit

ELEMENTS = [300, 7, 64]
SEEDS = st.integers(0, 2**32 - 1)


def honest_gradients(rng, n, sparse_fraction=0.3):
    """n gradients of one true direction plus batch noise, sparse or dense per tensor like browsers send."""
    true = [rng.normal(size=e) for e in ELEMENTS]
    out = []
    for _ in range(n):
        grads = [t + rng.normal(size=t.size) for t in true]
        out.append(grads)
    return true, out


def to_contribution(name, grads, samples=4, loss=3.0, rng=None, sparse_fraction=None, mode="unique"):
    """Sections of `grads`: dense, or its `sparse_fraction` largest entries (Mode 2 unique or Mode 1 repeats)."""
    sections = []
    for tid, g in enumerate(grads):
        g = np.asarray(g, np.float32)
        if sparse_fraction is None:
            sections.append(Section(tid, None, g))
            continue
        k = max(1, int(g.size * sparse_fraction))
        idx = np.sort(np.argpartition(np.abs(g), g.size - k)[g.size - k:]).astype(np.int64)
        if mode == "repeats":  # Mode 1: split each value over a repeated index, which must add up
            idx2 = np.concatenate([idx, idx])
            vals = np.concatenate([g[idx] * 0.25, g[idx] * 0.75]).astype(np.float32)
            sections.append(Section(tid, idx2, vals, unique=False))
        else:
            sections.append(Section(tid, idx, g[idx], unique=True))
    return Contribution(name, 0, samples, loss, tuple(sections))


def weighted_sum(contributions):
    acc = [np.zeros(e, np.float32) for e in ELEMENTS]
    for c in contributions:
        add_sections(acc, c.sections, float(c.samples))
    return acc


def mean_of(agg: Aggregate):
    return np.concatenate([s.astype(np.float64) for s in agg.sums]) / agg.samples


def honest_hand_over(seed, n, sparse=True):
    """n honest contributions of comparable size: similar norms, similar samples, mixed section modes."""
    rng = np.random.default_rng(seed)
    _, grads = honest_gradients(rng, n)
    out = []
    for i, g in enumerate(grads):
        frac = [None, 0.3, 0.3][i % 3] if sparse else None
        out.append(to_contribution(f"h{i}", g, samples=int(rng.integers(4, 7)), loss=float(rng.uniform(2, 4)),
                                   sparse_fraction=frac, mode="repeats" if i % 2 else "unique"))
    return out


# ---------------------------------------------------------------------------------------------
# honest hand-overs


@settings(max_examples=60, deadline=None)
@given(SEEDS, st.integers(1, 9))
def test_plain_config_is_the_samples_weighted_mean(seed, n):
    contribs = honest_hand_over(seed, n)
    agg = robust.aggregate(contribs, ELEMENTS, RobustConfig.plain())
    ref = weighted_sum(contribs)
    assert agg.samples == sum(c.samples for c in contribs)
    assert agg.loss_sum == pytest.approx(sum(c.samples * c.loss for c in contribs), rel=1e-12)
    for got, want in zip(agg.sums, ref):
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not agg.outliers


@settings(max_examples=60, deadline=None)
@given(SEEDS, st.integers(1, 9), st.sampled_from(["centered_clip", "mean"]))
def test_default_defences_leave_honest_hand_overs_exact(seed, n, method):
    """NOTES.md: with honest contributions of comparable size the robust default is the weighted mean."""
    contribs = honest_hand_over(seed, n)
    tracker = NormTracker(RobustConfig(method=method))
    agg = robust.aggregate(contribs, ELEMENTS, RobustConfig(method=method), tracker.bound())
    ref = weighted_sum(contribs)
    for got, want in zip(agg.sums, ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert agg.samples == sum(c.samples for c in contribs)
    assert all(r.clip_factor == 1 and r.center_factor == 1 and r.weight == r.samples for r in agg.reports)
    assert not agg.outliers


@settings(max_examples=40, deadline=None)
@given(SEEDS, st.integers(2, 8), st.sampled_from(robust.METHODS), st.randoms(use_true_random=False))
def test_a_permutation_of_contributors_changes_nothing(seed, n, method, shuffler):
    contribs = honest_hand_over(seed, n)
    rng = np.random.default_rng(seed)
    # with an outlier and two packets of one contributor with equal headers, so every code path runs
    contribs.append(to_contribution("h0", [1000 * rng.normal(size=e) for e in ELEMENTS], samples=4, loss=3.0))
    contribs.append(to_contribution("h0", [rng.normal(size=e) for e in ELEMENTS], samples=4, loss=3.0))
    permuted = list(contribs)
    shuffler.shuffle(permuted)
    cfg = RobustConfig(method=method)
    a, b = robust.aggregate(contribs, ELEMENTS, cfg, 50.0), robust.aggregate(permuted, ELEMENTS, cfg, 50.0)
    for x, y in zip(a.sums, b.sums):
        assert np.array_equal(x, y)
    assert a.reports == b.reports and a.samples == b.samples and a.loss_sum == b.loss_sum


def test_sparse_input_stays_sparse_in_the_output():
    rng = np.random.default_rng(1)
    _, grads = honest_gradients(rng, 4)
    contribs = [to_contribution(f"h{i}", g, sparse_fraction=0.05) for i, g in enumerate(grads)]
    agg = robust.aggregate(contribs, ELEMENTS)
    touched = set()
    for c in contribs:
        touched |= {(s.tensor_id, int(i)) for s in c.sections for i in s.indices}
    nonzero = {(t, int(i)) for t, s in enumerate(agg.sums) for i in np.flatnonzero(s)}
    assert nonzero <= touched
    # and the aggregate holds only what was touched: its parts are the union of the indices sent, per tensor
    held = {(t, int(i)) for t, coords, values in agg.parts for i in coords}
    assert held == touched and sum(v.size for _, _, v in agg.parts) == len(touched)


@settings(deadline=None, max_examples=30)
@given(SEEDS, st.integers(1, 5))
def test_a_pending_gradient_adds_the_sparse_parts_as_it_adds_the_dense_sums(seed, n):
    """The training thread adds `Aggregate.parts` (only the touched elements): the bits of adding `sums`."""
    from dtrain.node.train.gradient import PendingGradient
    rng = np.random.default_rng(seed)
    _, grads = honest_gradients(rng, n)
    contributions = [to_contribution(f"h{i}", g, samples=int(rng.integers(4, 7)), sparse_fraction=0.3,
                                     mode="repeats" if i % 2 else "unique") for i, g in enumerate(grads)]
    if seed % 2:  # and a dense one: whole tensors in the parts
        contributions.append(to_contribution("dense", grads[0]))
    agg = robust.aggregate(contributions, ELEMENTS)
    assert any(coords is not None for _, coords, _ in agg.parts) != bool(seed % 2)
    start = [torch.from_numpy(rng.standard_normal(e).astype(np.float32)) for e in ELEMENTS]
    dense, sparse = PendingGradient(ELEMENTS), PendingGradient(ELEMENTS)
    for g in (dense, sparse):
        g.sums = [s.clone() for s in start]
    dense.add(agg.sums, agg.samples, agg.loss_sum, packets=len(contributions))
    sparse.add_parts(agg.parts, agg.samples, agg.loss_sum, packets=len(contributions))
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(dense.sums, sparse.sums))
    assert (dense.samples, dense.packets, dense.loss_sum) == (sparse.samples, sparse.packets, sparse.loss_sum)


def test_empty_hand_over_and_single_contribution():
    empty = robust.aggregate([], ELEMENTS)
    assert empty.samples == 0 and all(not s.any() for s in empty.sums)
    rng = np.random.default_rng(2)
    (g,) = honest_gradients(rng, 1)[1]
    one = robust.aggregate([to_contribution("only", g, samples=3)], ELEMENTS)
    np.testing.assert_allclose(mean_of(one), np.concatenate(g), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# attacks: 10 contributors, 2 or 4 of them attacking


def attack_hand_over(seed, attack, n_bad, n=10):
    """Honest dense contributions and `n_bad` attackers; returns (contribs, honest mean, median honest norm)."""
    rng = np.random.default_rng(seed)
    true, grads = honest_gradients(rng, n)
    honest = [to_contribution(f"h{i}", g) for i, g in enumerate(grads[n_bad:])]
    flat = np.stack([np.concatenate(g) for g in grads[n_bad:]])
    mean = flat.mean(axis=0)
    m = float(np.median(np.linalg.norm(flat, axis=1)))
    bad = []
    for i, g in enumerate(grads[:n_bad]):
        if attack == "sign_flip":
            b, samples = [-x for x in g], 4
        elif attack == "scaled":
            b, samples = [1000 * x for x in g], 4
        elif attack == "noise":
            b, samples = [rng.normal(scale=100.0, size=e) for e in ELEMENTS], 4
        elif attack == "huge_samples":  # sign-flipped, claiming the most samples a packet can carry
            b, samples = [-x for x in g], 2**32 - 1
        else:  # "a little is enough" (Baruch et al. 2019): mean - z * std, z from n and the attackers
            from statistics import NormalDist
            s = n // 2 + 1 - n_bad
            z = NormalDist().inv_cdf((n - s) / n)
            shift = mean - z * flat.std(axis=0)
            b, samples = np.split(shift, np.cumsum(ELEMENTS)[:-1]), 4
        bad.append(to_contribution(f"a{i}", b, samples=samples, loss=1e30 if attack == "huge_samples" else 3.0))
    return honest + bad, mean, m, flat


# the median-multiple weight bound is off by default (the gate's cap bounds weight); these tests turn it on
WEIGHT_BOUNDED = RobustConfig(max_weight_multiple=2.0)
ATTACKS = ["sign_flip", "scaled", "noise", "huge_samples", "little_is_enough"]


@pytest.mark.parametrize("n_bad", [2, 4])
@pytest.mark.parametrize("attack", ATTACKS)
def test_each_attack_is_bounded(attack, n_bad):
    contribs, mean, m, flat = attack_hand_over(7, attack, n_bad)
    agg = robust.aggregate(contribs, ELEMENTS, WEIGHT_BOUNDED, norm_bound=None)
    plain = robust.aggregate(contribs, ELEMENTS, RobustConfig.plain())
    got = mean_of(agg)
    assert np.isfinite(got).all() and np.isfinite(agg.loss_sum)
    err, plain_err = np.linalg.norm(got - mean), np.linalg.norm(mean_of(plain) - mean)
    f = n_bad / 10
    # Whatever an attacker sends, after the bounds its gradient has norm <= clip_multiple * m and weight <=
    # max_weight_multiple x median; CenteredClip then keeps it within tau of the centre. Bound the damage by
    # the attackers' share of the weight times (the clip bound + the honest norm): far below the plain mean's.
    share = f * 2.0 / (f * 2.0 + (1 - f))
    assert err <= share * (WEIGHT_BOUNDED.clip_multiple + 1) * m
    bad = [r for r in agg.reports if r.contributor.startswith("a")]
    if attack in ("scaled", "noise"):  # far out: norm-clipped and pulled in, so the damage is small
        # pulled to within tau (tau_multiple x the median distance, about m) of the centre: f x tau at most
        assert all(r.outlier and r.clip_factor < 0.1 for r in bad)
        assert err <= f * (WEIGHT_BOUNDED.tau_multiple + 1) * m and plain_err >= 10 * err
    if attack == "huge_samples":  # counted with at most twice the median samples, loss history clamped
        assert all(r.outlier and r.weight == 8 for r in bad)
        assert agg.loss_sum / agg.samples <= WEIGHT_BOUNDED.max_loss
        # exactly what the same packets claiming twice the median would give
        fair = [c if c.contributor.startswith("h") else Contribution(c.contributor, c.step, 8, 3.0, c.sections)
                for c in contribs]
        again = robust.aggregate(fair, ELEMENTS, WEIGHT_BOUNDED, norm_bound=None)
        assert all(np.array_equal(x, y) for x, y in zip(agg.sums, again.sums))
    if attack == "sign_flip":  # in the honest norm range: no defence sees it; no worse than the mean
        assert err <= plain_err * 1.01
    if attack == "little_is_enough":  # inside the spread by construction: moved at most f x that shift
        shift = np.linalg.norm(flat.std(axis=0))
        assert err <= 1.5 * f * shift
    assert not any(r.outlier for r in agg.reports if r.contributor.startswith("h"))


def test_trimmed_mean_drops_the_tails():
    contribs, mean, m, _ = attack_hand_over(3, "scaled", 2)
    agg = robust.aggregate(contribs, ELEMENTS, RobustConfig(method="trimmed_mean", clip_multiple=0,
                                                            warmup_norm_bound=None))
    assert np.linalg.norm(mean_of(agg) - mean) <= 0.5 * m


def test_overflowing_values_are_clipped_not_infinite():
    """The issue's packet: 3e38 on three coordinates with samples 2**32 - 1, next to one honest packet."""
    rng = np.random.default_rng(0)
    honest = to_contribution("h", [rng.normal(size=e) for e in ELEMENTS], samples=4)
    evil = Contribution("evil", 0, 2**32 - 1, 3e38, (Section(0, np.array([1, 2, 3]), np.full(3, 3e38, np.float32),
                                                            unique=True),))
    cfg = RobustConfig(max_samples=64)  # the node's max_samples_per_packet: two packets have no median
    tracker = NormTracker(cfg)
    agg = robust.aggregate([honest, evil], ELEMENTS, cfg, tracker.bound(), tracker.samples_bound())
    assert robust.all_finite(agg.sums) and np.isfinite(agg.loss_sum)
    assert agg.samples == 4 + 64 and agg.norm_bound == RobustConfig().warmup_norm_bound
    (bad,) = [r for r in agg.reports if r.contributor == "evil"]
    assert bad.outlier and np.isfinite(bad.norm) and bad.norm > 1e38
    assert np.linalg.norm(agg.sums[0][1:4]) / agg.samples <= agg.norm_bound


# ---------------------------------------------------------------------------------------------
# the direction check (opt-in): sign flips against the momentum


DIRECTION = RobustConfig(min_cosine=-0.05)


@pytest.mark.parametrize("n_bad", [2, 4])
def test_direction_check_drops_sign_flips_and_is_exactly_the_honest_mean(n_bad):
    """The reference is the true direction (what the momentum of honest updates estimates): every flipped packet
    points against it, counts with weight 0, and the rest is the honest samples-weighted mean, to float32."""
    contribs, mean, _, _ = attack_hand_over(11, "sign_flip", n_bad)
    true, _ = honest_gradients(np.random.default_rng(11), 1)  # the same true direction attack_hand_over drew
    reference = [t.astype(np.float32) for t in true]
    agg = robust.aggregate(contribs, ELEMENTS, DIRECTION, reference=reference)
    honest = [c for c in contribs if c.contributor.startswith("h")]
    assert agg.samples == sum(c.samples for c in honest)
    for got, want in zip(agg.sums, weighted_sum(honest)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for r in agg.reports:
        if r.contributor.startswith("a"):
            assert r.outlier and r.weight == 0 and r.cosine < DIRECTION.min_cosine
        else:
            assert not r.outlier and r.weight == r.samples and r.cosine > 0
    plain = robust.aggregate(contribs, ELEMENTS, RobustConfig(), reference=reference)  # off: nothing checked
    assert all(r.cosine is None and r.weight == r.samples for r in plain.reports)


@settings(max_examples=30, deadline=None)
@given(SEEDS, st.integers(1, 9))
def test_direction_check_leaves_aligned_honest_hand_overs_exact(seed, n):
    contribs = honest_hand_over(seed, n)
    reference = [g.astype(np.float32) for g in weighted_sum(contribs)]  # the momentum of these same gradients
    agg = robust.aggregate(contribs, ELEMENTS, DIRECTION, reference=reference)
    for got, want in zip(agg.sums, weighted_sum(contribs)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not agg.outliers and agg.samples == sum(c.samples for c in contribs)
    zero = robust.aggregate(contribs, ELEMENTS, DIRECTION, reference=[np.zeros(e, np.float32) for e in ELEMENTS])
    assert all(r.cosine is None for r in zero.reports) and not zero.outliers  # no momentum yet: nothing to check


def test_a_hand_over_whose_only_packet_is_dropped_adds_nothing():
    rng = np.random.default_rng(5)
    g = [rng.normal(size=e) for e in ELEMENTS]
    agg = robust.aggregate([to_contribution("a", [-x for x in g], samples=7)], ELEMENTS, DIRECTION,
                           reference=[x.astype(np.float32) for x in g])
    assert agg.samples == 0 and agg.loss_sum == 0 and all(not s.any() for s in agg.sums)
    (r,) = agg.reports
    assert r.outlier and r.weight == 0 and r.cosine == pytest.approx(-1.0)


# ---------------------------------------------------------------------------------------------
# the norm history


def test_tracker_warms_up_then_follows_the_median_and_a_minority_cannot_move_it():
    cfg = RobustConfig(min_norms=10, norm_window=50)
    tracker = NormTracker(cfg)
    assert tracker.bound() == cfg.warmup_norm_bound
    agg = robust.RobustAggregator(cfg, ELEMENTS)
    rng = np.random.default_rng(4)
    for round_ in range(20):
        _, grads = honest_gradients(rng, 6)
        contribs = [to_contribution(f"h{i}", g) for i, g in enumerate(grads)]
        contribs += [to_contribution(f"a{i}", [1e6 * x for x in grads[i]]) for i in range(2)]  # 25% attackers
        result = agg.aggregate(contribs)
        assert {r.contributor for r in result.outliers} == {"a0", "a1"}
    honest_norm = np.median([r.norm for r in result.reports if r.contributor.startswith("h")])
    assert len(agg.tracker) == 50  # bounded window
    # the median of what went in is an honest norm: the bound is clip_multiple x about that
    assert agg.tracker.bound() == pytest.approx(cfg.clip_multiple * honest_norm, rel=0.1)


def test_fixed_bound_and_off():
    assert NormTracker(RobustConfig(norm_bound=2.5)).bound() == 2.5
    assert NormTracker(RobustConfig.plain()).bound() is None


def test_config_errors_name_the_option():
    with pytest.raises(RobustConfigError, match="method"):
        RobustConfig(method="median")
    with pytest.raises(RobustConfigError, match="trim_fraction"):
        RobustConfig(trim_fraction=0.5)
    with pytest.raises(RobustConfigError, match="min_norms"):
        RobustConfig(norm_window=4, min_norms=5)
    with pytest.raises(RobustConfigError, match="min_cosine"):
        RobustConfig(min_cosine=1.0)


def test_all_finite_on_parameters_and_adam_moments():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(4)
    opt.step()
    assert robust.all_finite([p, *robust.optimizer_state_tensors(opt)])
    opt.state[p]["exp_avg_sq"][2] = float("inf")
    assert not robust.all_finite([p, *robust.optimizer_state_tensors(opt)])
    assert not robust.all_finite([np.array([0.0, np.nan])])


@settings(deadline=None, max_examples=30)
@given(SEEDS, st.integers(1, 6), st.sampled_from(["mean", "trimmed_mean", "centered_clip"]))
def test_the_sorted_union_and_the_mask_over_the_tensor_give_the_same_bits(seed, n, method):
    """A tensor's touched elements are found by sorting the indices sent when they are few (`robust_stats._coordinates`), by a
    mask over the tensor otherwise: one hand-over aggregated both ways must come out the same, bit for bit."""
    rng = np.random.default_rng(seed)
    _, grads = honest_gradients(rng, n)
    contributions = [to_contribution(f"h{i}", g, samples=int(rng.integers(4, 7)), sparse_fraction=0.3,
                                     mode="repeats" if i % 2 else "unique") for i, g in enumerate(grads)]
    config = RobustConfig(method=method)
    saved = robust_stats.SPARSE_UNION_FRACTION
    try:
        robust_stats.SPARSE_UNION_FRACTION = 0  # every tensor: sorted
        sorted_union = robust.aggregate(contributions, ELEMENTS, config)
        robust_stats.SPARSE_UNION_FRACTION = 10**12  # every tensor: the mask
        mask = robust.aggregate(contributions, ELEMENTS, config)
    finally:
        robust_stats.SPARSE_UNION_FRACTION = saved
    for a, b in zip(sorted_union.sums, mask.sums):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert sorted_union.samples == mask.samples and sorted_union.loss_sum == mask.loss_sum
