"""The trusted reference (train/reference.py) and what robust aggregation does with it (train/robust.py): real
gradients of a tiny model on real text, judged against the node's own gradient on other text of the same corpus."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.bridge import dgrd
from dtrain.node import corpus
from dtrain.node.config import ModelConfig
from dtrain.node.contribution import Contribution, Section
from dtrain.node.data import TokenDataset
from dtrain.node.model import build_model
from dtrain.node.train import reference as ref_mod
from dtrain.node.train.reference import ReferenceConfig, ReferenceConfigError, ReferenceSource
from dtrain.node.train.robust import RobustConfig, aggregate
from tests.nodeproc import TINY_CONFIG

pytestmark = pytest.mark.unit

SEQ = 32


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = build_model(ModelConfig.load(TINY_CONFIG))
    data = TokenDataset(corpus.default_tokens()[:200_000])
    return model, data


def gradient(model, tokens) -> list[np.ndarray]:
    x = torch.from_numpy(tokens.astype(np.int64))
    model.zero_grad(set_to_none=True)
    model(input_ids=x, labels=x).loss.backward()
    return [p.grad.reshape(-1).numpy().copy() for p in model.parameters()]


def packet(node_id: str, grads, samples: int = 2, topk: float = 0.01) -> Contribution:
    """A real top-k DGRD packet of `grads`, decoded as the bridge decodes it."""
    elements = [g.size for g in grads]
    body = dgrd.encode(0, node_id, 3.0, samples, dgrd.topk_sections(grads, topk))
    p = dgrd.decode(body, elements)
    return Contribution(p.node_id, p.step, p.samples, p.train_loss, p.sections)


def test_the_reference_is_the_models_gradient_and_leaves_grad_buffers_alone(setup):
    model, data = setup
    tokens = data.batch(4, SEQ, np.random.default_rng(1))
    model.zero_grad(set_to_none=True)
    ref = ref_mod.compute(model, tokens, step=7)
    assert all(p.grad is None for p in model.parameters())  # autograd.grad: the optimizer's buffers untouched
    expected = gradient(model, tokens)
    for a, b in zip(ref.gradient, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert ref.step == 7 and ref.norm == pytest.approx(np.sqrt(sum(float(g @ g) for g in expected)), rel=1e-5)
    assert ref.seconds > 0 and 0 < ref.loss < 20


def test_one_reference_per_step_on_a_fresh_batch(setup):
    model, data = setup
    source = ReferenceSource(model, data, ReferenceConfig(batch_size=2, seq_len=SEQ), max_seq_len=64, seed=3)
    a = source.at(0)
    assert source.at(0) is a and source.computed == 1
    b = source.at(1)
    assert source.computed == 2 and b.step == 1 and b.loss != a.loss  # another batch
    assert source.seconds == pytest.approx(a.seconds + b.seconds)
    with pytest.raises(ReferenceConfigError):
        ReferenceConfig(batch_size=-1)
    with pytest.raises(ReferenceConfigError):
        ReferenceConfig(batch_size=1000)


def honest_packets(model, data, n: int, seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [gradient(model, data.batch(2, SEQ, rng)) for _ in range(n)]


def test_honest_real_gradients_agree_with_the_reference_and_keep_their_exact_mean(setup):
    model, data = setup
    ref = ref_mod.compute(model, data.batch(4, SEQ, np.random.default_rng(99)), 0)
    grads = honest_packets(model, data, 6, seed=5)
    contribs = [packet(f"h{i}", g, samples=2 + i % 3) for i, g in enumerate(grads)]
    elements = [g.size for g in grads[0]]
    config = RobustConfig(min_cosine=0.0)
    judged = aggregate(contribs, elements, config, reference=ref.gradient, trusted=True)
    plain = aggregate(contribs, elements, RobustConfig.plain())
    assert all(r.cosine > 0 and r.trusted and r.weight == r.samples and not r.outlier for r in judged.reports)
    assert judged.samples == plain.samples == sum(c.samples for c in contribs)
    for a, b in zip(judged.sums, plain.sums):
        np.testing.assert_array_equal(a, b)


def test_a_flipped_gradient_counts_zero_and_a_huge_one_is_bounded_by_the_reference_norm(setup):
    model, data = setup
    ref = ref_mod.compute(model, data.batch(4, SEQ, np.random.default_rng(98)), 0)
    grads = honest_packets(model, data, 6, seed=6)
    elements = [g.size for g in grads[0]]
    honest = [packet(f"h{i}", g) for i, g in enumerate(grads[:4])]
    flipped = packet("flip", [-g for g in grads[4]])  # the attackers' own batches: no copies of honest packets
    scaled = packet("x1000", [1000 * g for g in grads[5]])
    config = RobustConfig(min_cosine=0.0, clip_multiple=0.0)  # the reference's bound alone
    result = aggregate(honest + [flipped, scaled], elements, config, reference=ref.gradient, trusted=True)
    by = {r.contributor: r for r in result.reports}
    assert by["flip"].weight == 0 and by["flip"].cosine < 0
    assert by["x1000"].weight == 2 and by["x1000"].cosine > 0
    assert result.norm_bound == pytest.approx(config.reference_norm_multiple * ref.norm, rel=1e-6)
    assert by["x1000"].norm * by["x1000"].clip_factor == pytest.approx(result.norm_bound, rel=1e-6)
    assert all(by[f"h{i}"].clip_factor == 1.0 and by[f"h{i}"].weight == 2 for i in range(4))


def test_near_copies_count_once_and_a_scaled_copy_never_displaces_the_original(setup):
    model, data = setup
    grads = honest_packets(model, data, 3, seed=7)
    elements = [g.size for g in grads[0]]
    honest = [packet(f"h{i}", g) for i, g in enumerate(grads)]
    sybils = [packet(f"a{i}", [3 * g for g in grads[0]]) for i in range(3)]  # one party, three ids, h0 copied x3
    result = aggregate(honest + sybils, elements, RobustConfig())
    by = {r.contributor: r for r in result.reports}
    assert not by["h0"].duplicate and by["h0"].weight == 2  # the smallest of the group counts
    assert all(by[f"a{i}"].duplicate and by[f"a{i}"].weight == 0 for i in range(3))
    assert result.samples == 6


def test_a_new_contributor_counts_at_most_the_median_until_its_record_earns_the_multiple():
    rng = np.random.default_rng(0)
    contribs = [Contribution(f"c{i}", 0, s, 3.0, [Section(0, None, rng.normal(size=8).astype(np.float32))])
                for i, s in enumerate([2, 2, 2, 8, 256])]
    config = RobustConfig(max_samples=256)  # max_weight_multiple 4 by default
    weights = lambda ramps: {r.contributor: r.weight for r in aggregate(contribs, [8], config,  # noqa: E731
                                                                        ramps=ramps).reports}
    assert weights(None) == {"c0": 2, "c1": 2, "c2": 2, "c3": 8, "c4": 8}  # 4x the median 2
    assert weights({f"c{i}": 0.0 for i in range(5)}) == {"c0": 2, "c1": 2, "c2": 2, "c3": 2, "c4": 2}  # all new: 1x the median
    assert weights({"c3": 1.0, "c4": 0.5}) == {"c0": 2, "c1": 2, "c2": 2, "c3": 8, "c4": 5}
    excluded = aggregate(contribs, [8], config, excluded=frozenset({"c0"}))
    assert {r.contributor: r.weight for r in excluded.reports}["c0"] == 0
