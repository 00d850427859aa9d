"""The split-inference engine on the tiny model: its pre-activations give the full model's logits, incremental calls
equal full ones, sessions are isolated and stale ones refused, experts run with and without HE, DP noise is added,
and bad requests are typed errors."""
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dtrain.node.config import ModelConfig
from dtrain.node.model import build_model
from dtrain.node.split.dp import DPConfig, clip_and_noise
from dtrain.node.split.engine import (
    ForwardResult,
    HEUnavailableError,
    HiddenStateError,
    NoSessionError,
    SequenceTooLongError,
    SplitEngine,
    SplitError,
    StaleSessionError,
)
from dtrain.node.split.experts import ExpertRegistry, LoraExpert, UnknownExpertError, train_expert
from dtrain.node.split.he import HEContext
from dtrain.node.split.kv_cache import KVCacheStore

pytestmark = pytest.mark.unit

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.json"


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.load(TINY))


@pytest.fixture(scope="module")
def wte(model):
    return model.transformer.wte.weight.detach()


@pytest.fixture(scope="module")
def he_ctx():
    return HEContext(poly_modulus_degree=8192)


@pytest.fixture(scope="module")
def expert(model):
    d = model.config.n_embd
    rng = np.random.default_rng(7)
    return LoraExpert.from_matrices("banking", rng.normal(scale=0.3, size=(4, d)), rng.normal(scale=0.3, size=(d, 4)), 2.0)


class Step:
    def __init__(self, value: int = 0):
        self.value = value

    def __call__(self) -> int:
        return self.value


def make_engine(model, *, step=None, dp=DPConfig(), experts=None, he=None, max_seq_len=None, kv=None):
    return SplitEngine(
        model,
        step or Step(),
        kv or KVCacheStore(),
        dp,
        experts or ExpertRegistry(),
        he=he,
        max_seq_len=max_seq_len,
    )


def embed(wte, ids) -> np.ndarray:
    return wte[torch.as_tensor(ids)].numpy().astype(np.float32)


def logits(result: ForwardResult, wte) -> torch.Tensor:
    return torch.from_numpy(result.pre_activations) @ wte.T  # (T, V)


def test_pre_activations_give_the_full_models_logits(model, wte):
    engine = make_engine(model)
    ids = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    result = engine.forward(embed(wte, ids))
    with torch.no_grad():
        want = model(ids.unsqueeze(0)).logits[0]
    assert result.pre_activations.shape == (12, model.config.n_embd)
    assert result.pre_activations.dtype == np.float32
    assert torch.allclose(logits(result, wte), want, atol=1e-4, rtol=0)
    assert (result.he_active, result.dp_sigma, result.incremental, result.cached_seq_len) == (False, 0.0, False, 0)
    assert result.total_ms > 0


def test_greedy_incremental_generation_matches_generate(model, wte):
    engine = make_engine(model)
    prompt = [464, 2068, 7586, 21831, 18045]
    new_tokens = 10
    with torch.no_grad():
        want = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )[0, len(prompt):].tolist()

    got = []
    result = engine.forward(embed(wte, prompt), session_id="s1", incremental=False)
    for i in range(new_tokens):
        token = int(logits(result, wte)[-1].argmax())
        got.append(token)
        if i + 1 < new_tokens:
            result = engine.forward(embed(wte, [token]), session_id="s1", incremental=True)
            assert result.incremental and result.cached_seq_len == len(prompt) + i
    assert got == want


def test_incremental_equals_non_incremental(model, wte):
    engine = make_engine(model)
    ids = list(range(100, 116))
    full = engine.forward(embed(wte, ids)).pre_activations
    first = engine.forward(embed(wte, ids[:6]), session_id="a")
    parts = [first.pre_activations]
    for start, stop in ((6, 7), (7, 11), (11, 16)):
        r = engine.forward(embed(wte, ids[start:stop]), session_id="a", incremental=True)
        assert r.cached_seq_len == start
        parts.append(r.pre_activations)
    np.testing.assert_allclose(np.concatenate(parts), full, atol=1e-5, rtol=0)


def test_sessions_are_isolated_and_restart(model, wte):
    engine = make_engine(model)
    a, b = list(range(10, 18)), list(range(500, 508))
    want_a = engine.forward(embed(wte, a)).pre_activations
    want_b = engine.forward(embed(wte, b)).pre_activations
    engine.forward(embed(wte, a[:4]), session_id="a")
    engine.forward(embed(wte, b[:4]), session_id="b")
    got_a, got_b = [], []
    for i in range(4, 8):  # interleave the two sessions
        got_a.append(engine.forward(embed(wte, a[i:i + 1]), session_id="a", incremental=True).pre_activations)
        got_b.append(engine.forward(embed(wte, b[i:i + 1]), session_id="b", incremental=True).pre_activations)
    np.testing.assert_allclose(np.concatenate(got_a), want_a[4:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.concatenate(got_b), want_b[4:], atol=1e-5, rtol=0)
    # a non-incremental call restarts the session from position 0
    r = engine.forward(embed(wte, b[:2]), session_id="a")
    assert r.cached_seq_len == 0
    r = engine.forward(embed(wte, b[2:3]), session_id="a", incremental=True)
    assert r.cached_seq_len == 2
    np.testing.assert_allclose(r.pre_activations, want_b[2:3], atol=1e-5, rtol=0)


@pytest.mark.timeout(30)
def test_concurrent_sessions_in_threads(model, wte):
    engine = make_engine(model)
    seqs = {f"t{i}": list(range(1000 + 37 * i, 1000 + 37 * i + 10)) for i in range(4)}
    want = {sid: engine.forward(embed(wte, ids)).pre_activations for sid, ids in seqs.items()}
    got, errors = {}, []

    def run(sid, ids):
        try:
            parts = [engine.forward(embed(wte, ids[:3]), session_id=sid).pre_activations]
            for i in range(3, len(ids)):
                parts.append(engine.forward(embed(wte, ids[i:i + 1]), session_id=sid, incremental=True).pre_activations)
            got[sid] = np.concatenate(parts)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=item) for item in seqs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for sid in seqs:
        np.testing.assert_allclose(got[sid], want[sid], atol=1e-5, rtol=0)


def test_stale_session_refused_after_step_changes(model, wte):
    step = Step(5)
    engine = make_engine(model, step=step)
    ids = list(range(20, 30))
    engine.forward(embed(wte, ids[:5]), session_id="s")
    engine.forward(embed(wte, ids[5:6]), session_id="s", incremental=True)
    step.value = 6
    with pytest.raises(StaleSessionError, match="resend the whole sequence") as info:
        engine.forward(embed(wte, ids[6:7]), session_id="s", incremental=True)
    assert "step 5" in str(info.value) and "step 6" in str(info.value)
    assert isinstance(info.value, SplitError) and isinstance(info.value, ValueError)
    # the node publishes the new step's weights; a resent sequence then continues normally
    engine.load_weights(model.state_dict(), step=6)
    assert engine.weights_step == 6
    engine.forward(embed(wte, ids[:7]), session_id="s")
    r = engine.forward(embed(wte, ids[7:8]), session_id="s", incremental=True)
    assert r.cached_seq_len == 7


def test_engine_keeps_its_own_weights_until_load_weights(model, wte):
    engine = make_engine(model)
    ids = list(range(40, 48))
    before = engine.forward(embed(wte, ids)).pre_activations
    trained = build_model(ModelConfig.load(TINY))
    with torch.no_grad():
        trained.transformer.ln_f.weight.mul_(2.0)  # what a training step might do to the node's model
    assert np.array_equal(make_engine(model).forward(embed(wte, ids)).pre_activations, before)
    assert np.array_equal(engine.forward(embed(wte, ids)).pre_activations, before)
    engine.load_weights(trained.state_dict(), step=1)
    with torch.no_grad():
        trained.transformer.ln_f.weight.mul_(3.0)  # later training must not leak into the engine
    after = engine.forward(embed(wte, ids)).pre_activations
    np.testing.assert_allclose(after, before * 2.0 - model.transformer.ln_f.bias.detach().numpy(), atol=1e-5, rtol=0)
    assert torch.equal(model.transformer.ln_f.weight, build_model(ModelConfig.load(TINY)).transformer.ln_f.weight)


def test_unknown_expert_refused_and_empty_means_none(model, wte, expert):
    engine = make_engine(model, experts=ExpertRegistry([expert]))
    h = embed(wte, [1, 2, 3])
    with pytest.raises(UnknownExpertError, match="no expert 'legal'.*banking"):
        engine.forward(h, expert_name="legal")
    base = engine.forward(h).pre_activations
    assert np.array_equal(engine.forward(h, expert_name="").pre_activations, base)
    assert np.array_equal(engine.forward(h, expert_name=None).pre_activations, base)


def test_bad_requests_refused(model, wte):
    engine = make_engine(model, max_seq_len=16)
    d = model.config.n_embd
    with pytest.raises(HiddenStateError, match="hidden_dim 31"):
        engine.forward(np.zeros((3, d - 1), np.float32))
    with pytest.raises(HiddenStateError, match=">= 1"):
        engine.forward(np.zeros((0, d), np.float32))
    with pytest.raises(HiddenStateError, match="float32"):
        engine.forward(np.zeros((3, d), np.float64))
    with pytest.raises(HiddenStateError, match="shape"):
        engine.forward(np.zeros(d, np.float32))
    bad = np.zeros((2, d), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(HiddenStateError, match="NaN"):
        engine.forward(bad)
    with pytest.raises(SequenceTooLongError, match="0 cached \\+ 17 new positions exceed the node's 16"):
        engine.forward(np.zeros((17, d), np.float32))
    engine.forward(embed(wte, list(range(15))), session_id="long")
    engine.forward(embed(wte, [15]), session_id="long", incremental=True)
    with pytest.raises(SequenceTooLongError, match="16 cached \\+ 1 new"):
        engine.forward(embed(wte, [16]), session_id="long", incremental=True)
    with pytest.raises(NoSessionError, match="resend the whole sequence with incremental=false"):
        engine.forward(embed(wte, [1]), session_id="never-started", incremental=True)
    with pytest.raises(NoSessionError):
        engine.forward(embed(wte, [1]), session_id=None, incremental=True)
    with pytest.raises(SplitError, match="session_id"):
        engine.forward(embed(wte, [1]), session_id="")
    with pytest.raises(ValueError, match="max_seq_len"):
        make_engine(model, max_seq_len=model.config.n_positions + 1)


def test_expert_delta_applied_with_and_without_he(model, wte, expert, he_ctx):
    engine = make_engine(model, experts=ExpertRegistry([expert]), he=he_ctx)
    h = embed(wte, [11, 22, 33, 44])
    base = engine.forward(h).pre_activations
    plain = engine.forward(h, expert_name="banking")
    want = base + (base @ expert.A.T @ expert.B.T) * expert.scale
    assert not plain.he_active and plain.encrypt_ms == 0.0
    np.testing.assert_allclose(plain.pre_activations, want, atol=1e-5, rtol=1e-5)
    assert np.abs(plain.pre_activations - base).max() > 0.1  # the expert changes something

    enc = engine.forward(h, expert_name="banking", use_he=True)
    assert enc.he_active and enc.encrypt_ms > 0 and enc.compute_ms > 0 and enc.decrypt_ms > 0
    assert enc.total_ms >= enc.encrypt_ms + enc.compute_ms + enc.decrypt_ms
    delta_he, delta_plain = enc.pre_activations - base, plain.pre_activations - base
    assert np.linalg.norm(delta_he - delta_plain) / np.linalg.norm(delta_plain) < 1e-3
    # without an expert there is nothing to encrypt
    assert engine.forward(h, use_he=True).he_active is False
    with pytest.raises(HEUnavailableError, match="use_he=false"):
        make_engine(model, experts=ExpertRegistry([expert])).forward(h, expert_name="banking", use_he=True)


def test_dp_noise_on_the_final_hidden_state(model, wte):
    dp = DPConfig(clip=1.0, epsilon=1.0, delta=1e-5)
    clean = make_engine(model).forward(embed(wte, [5, 6, 7])).pre_activations
    engine = make_engine(model, dp=dp)
    r1 = engine.forward(embed(wte, [5, 6, 7]), seed=123)
    r2 = engine.forward(embed(wte, [5, 6, 7]), seed=123)
    r3 = engine.forward(embed(wte, [5, 6, 7]))
    assert round(r1.dp_sigma, 4) == 4.8448
    assert np.array_equal(r1.pre_activations, r2.pre_activations)
    assert not np.array_equal(r1.pre_activations, r3.pre_activations)
    want = clip_and_noise(torch.from_numpy(clean), 1.0, dp.sigma, torch.Generator().manual_seed(123)).numpy()
    np.testing.assert_allclose(r1.pre_activations, want, atol=1e-4, rtol=0)


def test_train_expert_lowers_loss_and_round_trips(model, tmp_path):
    text = torch.randint(0, 500, (4, 16), generator=torch.Generator().manual_seed(3))
    trained, losses = train_expert(model, text, name="toy", r=4, alpha=8, steps=15, lr=3e-2)
    assert len(losses) == 15 and losses[-1] < losses[0] - 0.1
    assert trained.A.shape == (4, model.config.n_embd) and trained.B.shape == (model.config.n_embd, 4)
    assert trained.scale == 2.0 and np.abs(trained.B).max() > 0
    trained.save(tmp_path / "toy")
    loaded = LoraExpert.load(tmp_path / "toy")
    assert loaded.name == "toy" and loaded.scale == trained.scale
    assert np.array_equal(loaded.A, trained.A) and np.array_equal(loaded.B, trained.B)
    h = torch.randn(3, model.config.n_embd)
    with torch.no_grad():
        assert torch.equal(loaded.delta(h), trained.delta(h))
    registry = ExpertRegistry.load_dir(tmp_path)
    assert registry.names() == ["toy"] and registry.get("toy").r == 4
    # the frozen model was not touched
    assert all(p.grad is None for p in model.parameters())
