"""The split-inference protocol against real `dtrain-node` processes (configs/tiny.json) on 127.0.0.1.

Two node processes, one after the other: `plain` (no DP, hosts one LoRA expert with HE) for most tests,
and `training` (trains on a small text, so its step moves under a session) for the stale-session test.
DP and the `--split-model` path (GPT-2 and Llama-style) are served by the same SplitService and routes
in-process: one node process costs 10-40 s of start-up on a small machine.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web

from dtrain.bridge import http, split_routes
from dtrain.clients.split_client import AsyncSplitClient, SamplingConfig
from dtrain.flags import parse_config
from dtrain.node.config import ModelConfig
from dtrain.node.model import build_model
from dtrain.node.split.dp import clip_rows
from dtrain.node.split.config import SplitConfig
from dtrain.node.split.experts import LoraExpert
from dtrain.node.split.service import from_pretrained
from dtrain.node.tokenizer import load_tokenizer
from tests.texts import shakespeare
from tests.inproc import InProcessNode
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until

pytestmark = [pytest.mark.http, pytest.mark.timeout(180)]

EXPERT = "banking"


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.load(TINY_CONFIG))  # a fresh node at step 1 has exactly these weights


@pytest.fixture(scope="module")
def wte(model):
    return model.transformer.wte.weight.detach()


@pytest.fixture(scope="module")
def expert_dir(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("expert") / EXPERT
    rng = np.random.default_rng(3)
    d = model.config.n_embd
    LoraExpert.from_matrices(EXPERT, rng.normal(scale=0.3, size=(4, d)), rng.normal(scale=0.3, size=(d, 4)), 2.0).save(path)
    return path


@pytest.fixture(scope="module")
def nodes(expert_dir):
    proc = InProcessNode("plain", ["--model-config", str(TINY_CONFIG), "--expert", f"{EXPERT}={expert_dir}"], new_run_id())
    try:
        proc.wait_ready()
        yield {"plain": proc}
    finally:
        proc.kill()


@pytest.fixture
def training_node(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text(shakespeare(20_000))
    proc = InProcessNode("training", ["--model-config", str(TINY_CONFIG), "--train-data", str(text),
                                    "--target-batch-size", "8", "--local-batch-size", "8", "--local-seq-len", "32"],
                       new_run_id())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@contextlib.asynccontextmanager
async def serve_in_process(service):
    """The split routes of `service` on a real aiohttp server at 127.0.0.1:<free port>; yields its URL."""
    app = web.Application()
    http.install(app)
    split_routes.add_routes(app, service)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def ws_url(node) -> str:
    return (node if isinstance(node, str) else node.url) + "/api/v1/split/stream"


async def exchange(node, messages: list) -> list[dict]:
    """Send each message (a dict, or a raw string) on one socket and collect the answers in order."""
    answers = []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(ws_url(node), max_msg_size=0) as ws:
            for message in messages:
                if isinstance(message, str):
                    await ws.send_str(message)
                else:
                    await ws.send_json(message)
                answers.append(await ws.receive_json(timeout=60))
    return answers


def talk(node, messages):
    return asyncio.run(exchange(node, messages))


def forward_msg(hidden: np.ndarray, **extra) -> dict:
    T, d = hidden.shape
    return {"type": "forward", "hidden_states": base64.b64encode(hidden.astype("<f4").tobytes()).decode(),
            "seq_len": T, "hidden_dim": d, **extra}


def pre_acts(answer: dict, d: int) -> np.ndarray:
    assert answer["type"] == "forward", answer
    return np.frombuffer(base64.b64decode(answer["pre_activations"]), dtype="<f4").reshape(-1, d).copy()


def post(node, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(node.url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def embed(wte, ids) -> np.ndarray:
    return wte[torch.as_tensor(ids)].numpy().astype(np.float32)


# ---- config and tokenize -----------------------------------------------------------------------------


def test_config_fields(nodes, model):
    config, = talk(nodes["plain"], [{"type": "config"}])
    assert config["type"] == "config"
    assert config["model"] == "dtrain-tiny"
    assert config["hidden_size"] == 32 and config["vocab_size"] == 50257 and config["max_seq_len"] == 64
    manifest = nodes["plain"].get_json("/api/v1/model/manifest")["tensors"]
    assert manifest[config["embedding_tensor_id"]]["name"] == "transformer.wte.weight"
    assert config["experts"] == [EXPERT]
    assert config["he"]["available"] is True
    assert config["dp"] == {"epsilon": 0.0, "delta": 1e-5, "clip": 1.0, "sigma": 0.0}
    assert config["step"] == nodes["plain"].get_json("/api/v1/model/info")["step"]
    assert nodes["plain"].get_json("/api/v1/split/config") == config


def test_tokenize_matches_node_tokenizer(nodes):
    text = "What is a savings account? Ünïcode, too — 123."
    answer, = talk(nodes["plain"], [{"type": "tokenize", "text": text}])
    want = load_tokenizer().encode(text).ids
    assert answer == {"type": "tokenize", "token_ids": want, "length": len(want)}
    status, body = post(nodes["plain"], "/api/v1/split/tokenize", json.dumps({"text": text}).encode())
    assert status == 200 and body["token_ids"] == want


# ---- forward -----------------------------------------------------------------------------------------


def test_pre_activations_give_the_models_logits(nodes, model, wte):
    ids = torch.randint(0, 50257, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    # the whole sequence at once, then the same positions as a session: 12 full + 8 incremental
    hidden = embed(wte, ids)
    full, first, *rest = talk(nodes["plain"], [
        forward_msg(hidden),
        forward_msg(hidden[:12], session_id="s1"),
        *[forward_msg(hidden[i:i + 1], session_id="s1", incremental=True) for i in range(12, 20)],
    ])
    assert full["dp_sigma"] == 0.0 and full["he_active"] is False and full["step"] == 1
    got = torch.from_numpy(pre_acts(full, 32)) @ wte.T
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert first["cached_seq_len"] == 0 and first["incremental"] is False and first["session_id"] == "s1"
    assert [a["cached_seq_len"] for a in rest] == list(range(12, 20))
    assert all(a["incremental"] for a in rest)
    session = np.concatenate([pre_acts(first, 32)] + [pre_acts(a, 32) for a in rest])
    torch.testing.assert_close(torch.from_numpy(session) @ wte.T, want, atol=1e-4, rtol=0)
    # HTTP gives the same numbers
    status, body = post(nodes["plain"], "/api/v1/split/forward", json.dumps(forward_msg(hidden)).encode())
    assert status == 200 and body["type"] == "forward"
    np.testing.assert_allclose(pre_acts(body, 32), pre_acts(full, 32), atol=1e-6)


def test_expert_with_and_without_he(nodes, wte):
    hidden = embed(wte, list(range(100, 110)))
    plain, he, none = talk(nodes["plain"], [
        forward_msg(hidden, expert_name=EXPERT, use_he=False),
        forward_msg(hidden, expert_name=EXPERT, use_he=True),
        forward_msg(hidden, expert_name=None, use_he=True),
    ])
    assert plain["he_active"] is False and he["he_active"] is True and none["he_active"] is False
    assert he["encrypt_ms"] > 0 and he["decrypt_ms"] > 0 and plain["encrypt_ms"] == 0
    a, b, c = pre_acts(plain, 32), pre_acts(he, 32), pre_acts(none, 32)
    assert np.linalg.norm(a - c) > 1e-2  # the expert changes the output
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 1e-3


def test_dp_noise(tmp_path, model, wte):
    # the tiny shared model as a --split-model directory, served with --dp-epsilon 1 --dp-clip 1 --dp-delta 1e-5
    model.save_pretrained(tmp_path / "gpt2")
    config = parse_config(["--dp-epsilon", "1", "--dp-clip", "1", "--dp-delta", "1e-5"]).split
    service = from_pretrained(tmp_path / "gpt2", config)
    ids = torch.randint(0, 50257, (4, 64), generator=torch.Generator().manual_seed(2))

    async def run():
        async with serve_in_process(service) as url:
            return await exchange(url, [{"type": "config"}] + [forward_msg(embed(wte, row)) for row in ids])

    config, *answers = asyncio.run(run())
    assert round(config["dp"]["sigma"], 4) == 4.8448
    assert all(round(a["dp_sigma"], 4) == 4.8448 for a in answers)
    with torch.no_grad():
        clean = model.transformer(input_ids=ids).last_hidden_state  # (4, 64, d)
    clipped = torch.stack([clip_rows(h, 1.0) for h in clean]).numpy()
    noise = np.stack([pre_acts(a, 32) for a in answers]) - clipped
    assert abs(noise.std() / answers[0]["dp_sigma"] - 1) < 0.05
    assert abs(noise.mean()) < 0.2


# ---- bad input ---------------------------------------------------------------------------------------


def _bad_messages(wte) -> list[tuple[str, object, str]]:
    good = forward_msg(embed(wte, [1, 2, 3]))
    return [
        ("bad base64", {**good, "hidden_states": "!!!not base64"}, "base64"),
        ("byte count", {**good, "seq_len": 4}, "bytes"),
        ("hidden_dim", {**good, "hidden_dim": 16}, "hidden_dim"),
        ("too long", forward_msg(np.zeros((65, 32), np.float32)), "seq_len"),
        ("nan", forward_msg(np.full((2, 32), np.nan, np.float32)), "NaN"),
        ("unknown expert", {**good, "expert_name": "nope"}, "expert"),
        ("unknown type", {"type": "launch"}, "unknown message type"),
        ("no session", {**good, "session_id": "never", "incremental": True}, "resend"),
        ("invalid json", "{not json", "JSON"),
        ("not an object", "[1, 2]", "object"),
    ]


def test_bad_input_answers_error_and_socket_stays(nodes, wte):
    bad = _bad_messages(wte)
    limit = talk(nodes["plain"], [{"type": "config"}])[0]["max_frame_bytes"]
    oversize = json.dumps({"type": "ping", "pad": "x" * (limit + 10)})
    messages = []
    for _, message, _ in bad + [("oversize", oversize, "limit")]:
        messages += [message, {"type": "ping"}]
    answers = talk(nodes["plain"], messages)
    for (what, _, needle), error, pong in zip(bad + [("oversize", None, "limit")], answers[::2], answers[1::2]):
        assert error["type"] == "error", (what, error)
        assert needle.lower() in error["message"].lower(), (what, error)
        assert pong == {"type": "pong"}, what


def test_bad_input_over_http_is_400(nodes, wte):
    for what, message, needle in _bad_messages(wte):
        body = message.encode() if isinstance(message, str) else json.dumps(message).encode()
        if what == "unknown type":
            body = json.dumps({**forward_msg(embed(wte, [1])), "type": "launch"}).encode()
            needle = "forward"
        status, answer = post(nodes["plain"], "/api/v1/split/forward", body)
        assert status == 400, (what, answer)
        assert answer["ok"] is False and needle.lower() in answer["message"].lower(), (what, answer)
    limit = nodes["plain"].get_json("/api/v1/split/config")["max_frame_bytes"]
    status, answer = post(nodes["plain"], "/api/v1/split/forward", b" " * (limit + 1))
    assert status == 413 and answer["ok"] is False


def test_frame_past_aiohttp_limit_closes_with_1009(nodes):
    limit = nodes["plain"].get_json("/api/v1/split/config")["max_frame_bytes"]

    async def run():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(ws_url(nodes["plain"])) as ws:
                await ws.send_str("x" * (2 * limit + 1))
                msg = await ws.receive(timeout=30)
                return msg.type, msg.data

    kind, code = asyncio.run(run())
    assert kind == aiohttp.WSMsgType.CLOSE and code == 1009


# ---- sessions across model steps ---------------------------------------------------------------------


@pytest.mark.slow
def test_stale_session_is_refused_after_a_step(training_node, wte):
    node = training_node
    hidden = embed(wte, [10, 20, 30, 40])

    async def run():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(ws_url(node)) as ws:
                await ws.send_json(forward_msg(hidden, session_id="old"))
                first = await ws.receive_json(timeout=60)
                assert first["type"] == "forward", first
                started = node.get_json("/api/v1/model/info")["step"]
                await asyncio.to_thread(wait_until, lambda: node.get_json("/api/v1/model/info")["step"] != started,
                                        60, "the training node to step", 0.2)
                await ws.send_json(forward_msg(hidden[:1], session_id="old", incremental=True))
                stale = await ws.receive_json(timeout=60)
                await ws.send_json({"type": "ping"})
                pong = await ws.receive_json(timeout=60)
                # the whole sequence again restarts the session on the new weights (once the split engine has
                # loaded them: it reloads on the training thread right after the node publishes a step)
                moved = node.get_json("/api/v1/model/info")["step"]
                await asyncio.to_thread(wait_until, lambda: node.get_json("/api/v1/split/config")["step"] >= moved,
                                        60, "the split engine to load the new step", 0.2)
                await ws.send_json(forward_msg(hidden, session_id="old"))
                again = await ws.receive_json(timeout=60)
                return first, stale, pong, again

    first, stale, pong, again = asyncio.run(run())
    assert stale["type"] == "error" and stale["code"] == "stale_session"
    assert "resend the whole sequence" in stale["message"]
    assert pong == {"type": "pong"}
    assert again["type"] == "forward" and again["step"] > first["step"]


# ---- a local Llama-style model (rotary positions) served in-process -----------------------------------


def test_split_model_llama_rotary(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama = LlamaForCausalLM(cfg).eval()
    llama.save_pretrained(tmp_path / "llama")
    service = from_pretrained(tmp_path / "llama", SplitConfig())
    assert service.step == 0 and not service.facts.tied_lm_head
    prompt = [5, 17, 99, 3, 250, 7]
    with torch.no_grad():
        want = llama.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              repetition_penalty=1.3, pad_token_id=0)[0, len(prompt):].tolist()

    async def run():
        async with serve_in_process(service) as url:
            async with AsyncSplitClient(url, weights_format="f32", transport="ws") as client:
                assert client.config["embedding_tensor_id"] is None
                return await client.generate(prompt, 12, SamplingConfig(repetition_penalty=1.3), stop_token_ids=[2])

    got = asyncio.run(run())
    assert got == want[:len(got)] and len(got) == len(want)
