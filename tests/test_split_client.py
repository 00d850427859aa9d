"""The reference split client against a real `dtrain-node` (configs/tiny.json), and its sampling on its own."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from dtrain.clients.split_client import SamplingConfig, SplitClient, apply_repetition_penalty, sample
from dtrain.node.config import ModelConfig
from dtrain.node.model import build_model
from tests.inproc import InProcessNode
from tests.nodeproc import TINY_CONFIG, new_run_id

pytestmark = pytest.mark.http

PROMPT = [464, 2068, 7586, 21831, 18045, 625]


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.load(TINY_CONFIG))


@pytest.fixture(scope="module")
def node():
    proc = InProcessNode("split", ["--model-config", str(TINY_CONFIG)], new_run_id())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


def reference(model, prompt, n, penalty=1.0) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             repetition_penalty=penalty, pad_token_id=50256)
    return out[0, len(prompt):].tolist()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_matches_transformers_over_ws_and_http(node, model, penalty):
    want = reference(model, PROMPT, 16, penalty)
    with SplitClient(node.url, transport="auto", weights_format="f32") as ws_client:
        assert ws_client.using_websocket
        got_ws = ws_client.generate(PROMPT, 16, repetition_penalty=penalty, stop_token_ids=[50256])
        assert ws_client.last_answer["incremental"] and ws_client.last_answer["cached_seq_len"] == len(PROMPT) + 14
    with SplitClient(node.url, transport="http", weights_format="f32") as http_client:
        assert not http_client.using_websocket
        got_http = http_client.generate(PROMPT, 16, repetition_penalty=penalty, stop_token_ids=[50256])
    assert got_ws == want
    assert got_http == want


@pytest.mark.timeout(180)
def test_f16_weights_text_prompt_and_fallback_mid_session(node, model):
    with SplitClient(node.url, weights_format="f16") as client:
        ids = client.tokenize("The quick brown fox")
        assert ids == [464, 2068, 7586, 21831]
        assert client.wte.dtype == np.float32 and client.wte.shape == (50257, 32)
        want = reference(model, ids, 8, 1.3)
        assert client.generate("The quick brown fox", 8, repetition_penalty=1.3) == want
        # the socket breaks: the next request goes over HTTP and the session's cache is still on the node
        client.request({"type": "ping"})
        client._run(client._client._ws.close())
        assert client.generate(ids, 8, repetition_penalty=1.3) == want
        assert not client.using_websocket
        # client-side noise: the node no longer receives the exact embedding rows
        client._client.noise_sigma = 0.05
        noisy = client.embed(ids)
        assert (noisy - client.wte[ids]).std() == pytest.approx(0.05, rel=0.3)


def test_repetition_penalty_matches_transformers():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=100).astype(np.float32)
    seen = [3, 7, 7, 50]
    want = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([seen]), torch.from_numpy(logits.copy())[None])[0]
    np.testing.assert_allclose(apply_repetition_penalty(logits, seen, 1.5), want.numpy(), rtol=1e-6)


def test_sampling_filters():
    rng = np.random.default_rng(0)
    logits = np.array([5.0, 4.0, 1.0, 0.5, -3.0], dtype=np.float32)
    assert sample(logits, SamplingConfig(), rng) == 0
    top2 = {sample(logits, SamplingConfig(temperature=1.0, top_k=2), rng) for _ in range(300)}
    assert top2 == {0, 1}
    # p(0) ~ 0.72 < 0.8, so the nucleus for top_p 0.8 is {0, 1}; for 0.5 it is {0}
    assert {sample(logits, SamplingConfig(temperature=1.0, top_p=0.8), rng) for _ in range(300)} == {0, 1}
    assert {sample(logits, SamplingConfig(temperature=1.0, top_p=0.5), rng) for _ in range(50)} == {0}
