"""Differential privacy of split inference: the Gaussian mechanism's sigma, per-position clipping, and the noise."""
import math

import pytest
import torch

from dtrain.node.split.dp import DPConfig, clip_and_noise, clip_rows, dp_sigma

pytestmark = pytest.mark.unit


def test_sigma_formula_and_protocol_value():
    assert round(dp_sigma(1.0, 1.0, 1e-5), 4) == 4.8448
    assert round(DPConfig(clip=1.0, epsilon=1.0, delta=1e-5).sigma, 4) == 4.8448
    assert dp_sigma(2.5, 0.5, 1e-6) == pytest.approx(2.5 * math.sqrt(2 * math.log(1.25e6)) / 0.5)
    assert dp_sigma(1.0, 0.0, 1e-5) == 0.0
    assert DPConfig().sigma == 0.0 and not DPConfig().enabled


@pytest.mark.parametrize("kwargs", [{"clip": 0}, {"epsilon": -1}, {"delta": 0}, {"delta": 1}, {"clip": float("inf")}])
def test_bad_options_raise(kwargs):
    with pytest.raises(ValueError):
        DPConfig(**kwargs)


def test_clipping_bounds_each_row_and_leaves_short_rows():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 16, generator=g) * 5
    h[2] = h[2] / h[2].norm() * 0.3  # already inside the ball
    clipped = clip_rows(h, 1.0)
    norms = clipped.norm(dim=-1)
    assert torch.allclose(norms[[0, 1, 3, 4, 5]], torch.ones(5), atol=1e-6)
    assert torch.equal(clipped[2], h[2])
    # direction is kept
    cos = torch.nn.functional.cosine_similarity(clipped, h, dim=-1)
    assert torch.allclose(cos, torch.ones(6), atol=1e-6)
    # sigma 0: clipping only
    assert torch.equal(clip_and_noise(h, 1.0, 0.0), clipped)


def test_noise_std_matches_sigma():
    sigma = DPConfig(clip=1.0, epsilon=1.0, delta=1e-5).sigma
    h = torch.zeros(400, 1000)  # clipping leaves zero rows alone: the output is pure noise
    out = clip_and_noise(h, 1.0, sigma, torch.Generator().manual_seed(1))
    assert abs(out.mean().item()) < 0.02 * sigma
    assert abs(out.std().item() - sigma) < 0.02 * sigma
    # the same generator seed gives the same noise
    again = clip_and_noise(h, 1.0, sigma, torch.Generator().manual_seed(1))
    assert torch.equal(out, again)


def test_epsilon_zero_is_exact_passthrough():
    h = torch.randn(3, 8) * 10
    out = DPConfig(clip=1.0, epsilon=0.0).apply(h, torch.Generator().manual_seed(0))
    assert out is h and torch.equal(out, h.clone())
