"""HE-LoRA: the expert's delta computed on a CKKS-encrypted hidden state equals the plaintext one within CKKS's
precision, and bad inputs are typed errors."""
import numpy as np
import pytest

from dtrain.node.split.he import HEContext, HEError, he_lora_delta

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def ctx():
    return HEContext(poly_modulus_degree=8192)


def rel_err(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("r", [4, 8])
def test_he_delta_matches_plaintext_single_position(ctx, r):
    rng = np.random.default_rng(r)
    d = 32
    h = rng.normal(size=d).astype(np.float32)
    A = rng.normal(scale=0.2, size=(r, d)).astype(np.float32)
    B = rng.normal(scale=0.2, size=(d, r)).astype(np.float32)
    delta, timings = he_lora_delta(ctx, h, A, B, 2.0)
    want = (B.astype(np.float64) @ (A.astype(np.float64) @ h)) * 2.0
    assert delta.shape == (d,) and delta.dtype == np.float32
    assert rel_err(delta, want) < 1e-3
    assert set(timings) == {"encrypt_ms", "compute_ms", "decrypt_ms"}
    assert all(v >= 0 for v in timings.values())


@pytest.mark.parametrize("d,r,T", [(32, 8, 5), (20, 4, 3), (2048, 3, 2)])
def test_he_delta_matches_plaintext_many_positions(ctx, d, r, T):
    # (32, 8, 5): 16 positions per ciphertext; (20, 4, 3): d padded to 32;
    # (2048, 3, 2): 2 blocks per ciphertext, so one position's ranks span ciphertexts
    rng = np.random.default_rng(d + r + T)
    h = rng.normal(size=(T, d)).astype(np.float32)
    A = rng.normal(scale=0.1, size=(r, d))
    B = rng.normal(scale=0.1, size=(d, r))
    delta, _ = he_lora_delta(ctx, h, A, B, 0.5)
    want = (h @ A.T @ B.T) * 0.5
    assert delta.shape == (T, d)
    for t in range(T):
        assert rel_err(delta[t], want[t]) < 1e-3


def test_he_rejects_mismatched_shapes(ctx):
    with pytest.raises(HEError, match="hidden size 32"):
        he_lora_delta(ctx, np.zeros(32), np.zeros((4, 16)), np.zeros((32, 4)), 1.0)
    with pytest.raises(HEError, match="slots"):
        he_lora_delta(ctx, np.zeros(8192), np.zeros((1, 8192)), np.zeros((8192, 1)), 1.0)
