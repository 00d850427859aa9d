"""The /v1 API of a real node, called by the official `openai` Python client over real HTTP.

One TrainingNode runs in this process (alone in its swarm, tiny model), with the app the composition root builds
served by aiohttp on 127.0.0.1 from a thread; the client is openai 3.54.0, unchanged. Every answer is checked
against the node's state: the step it serves, the text the engine wrote, the rows of the capture database.
"""
from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import urllib.request

import numpy as np
import openai
import pytest
from aiohttp import web

from dtrain.bridge.app import create_app
from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig, NodeConfig, SwarmConfig, TrainConfig
from dtrain.node.contribution import Contribution, Section
from dtrain.node.serve.config import ServeConfig
from dtrain.node.serve.service import for_node
from dtrain.node.split.experts import ExpertRegistry, LoraExpert
from dtrain.node.tokenizer import load_tokenizer
from dtrain.node.train.trainer import TrainingNode
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until

pytestmark = [pytest.mark.http, pytest.mark.timeout(180)]

MODEL = json.loads(TINY_CONFIG.read_text())["name"]
EXPERT = "banking"  # a LoRA expert the node hosts, served by name


class _Server:
    """An aiohttp app on 127.0.0.1 in a thread with its own event loop (the openai client is synchronous)."""

    def __init__(self, app: web.Application):
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
            ready.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(30)
        self.port = self.runner.addresses[0][1]

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    db = tmp_path_factory.mktemp("capture") / "capture.sqlite"
    serve_config = ServeConfig(capture_db=str(db), max_batch=2, max_n=2, queue_size=0, max_tokens=40,
                               capture_max_rows=50)
    config = NodeConfig(swarm=SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=new_run_id()),
                        serve=serve_config)
    node = TrainingNode(config, ModelConfig.load(TINY_CONFIG), TrainConfig())
    node.start()
    tokenizer = load_tokenizer(DEFAULT_STATIC_DIR)
    rng = np.random.default_rng(3)
    d = node.model_config.d_model
    experts = ExpertRegistry()
    experts.add(LoraExpert.from_matrices(EXPERT, rng.normal(scale=0.5, size=(4, d)), rng.normal(scale=0.5, size=(d, 4)),
                                         4.0))
    serve = for_node(node, serve_config, tokenizer, experts=experts)
    server = _Server(create_app(node, config, tokenizer=tokenizer, serve=serve))
    try:
        yield {"node": node, "serve": serve, "db": db, "port": server.port, "tokenizer": tokenizer}
    finally:
        server.close()
        serve.close()
        node.stop()


@pytest.fixture
def client(served):
    # no retries: a 429 must reach the test, not be retried away
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served['port']}/v1", api_key="none", max_retries=0, timeout=60)


def _rows(db, completion_id: str) -> list[dict]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM completions WHERE id = ? ORDER BY choice", (completion_id,))]


def test_models_lists_the_shared_model_at_its_step(client, served):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, EXPERT]
    assert [m.model_extra["dtrain_expert"] for m in models.data] == [False, True]
    assert models.data[0].model_extra["dtrain_step"] == served["node"].step == 1
    assert client.models.retrieve(MODEL).model_extra["context_length"] == 64
    with urllib.request.urlopen(f"http://127.0.0.1:{served['port']}/v1/models", timeout=60) as r:
        assert json.loads(r.read())["dtrain_capture"] == {"recording": True, "max_rows": 50}  # what it keeps, said
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


def test_completion_is_the_engines_text_and_is_recorded(client, served):
    tok = served["tokenizer"]
    r = client.completions.create(model=MODEL, prompt="To be, or not to be", max_tokens=6, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL
    assert r.system_fingerprint == "dtrain-step-1" and r.model_extra["dtrain_step"] == 1
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(tok.encode("To be, or not to be").ids)
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset[0] == 0 and all(len(t) == 2 for t in choice.logprobs.top_logprobs)
    [row] = _rows(served["db"], r.id)
    assert (row["completion"], row["step"], row["endpoint"], row["finish_reason"]) == (choice.text, 1,
                                                                                     "text_completion", "length")
    assert tok.decode(json.loads(row["completion_ids"])) == choice.text
    assert row["prompt"] == "To be, or not to be" and json.loads(row["params"])["max_tokens"] == 6
    assert row["reward"] is None and row["total_ms"] > 0
    again = client.completions.create(model=MODEL, prompt="To be, or not to be", max_tokens=6, temperature=0)
    assert again.choices[0].text == choice.text  # greedy on the same step: the same text


def test_a_lora_expert_is_served_by_name(client, served):
    kwargs = dict(prompt="To be, or not to be", max_tokens=6, temperature=0)
    bare = client.completions.create(model=MODEL, **kwargs)
    expert = client.completions.create(model=EXPERT, **kwargs)
    assert expert.model == EXPERT and expert.choices[0].text != bare.choices[0].text
    assert expert.model_extra["dtrain_step"] == 1
    [row] = _rows(served["db"], expert.id)
    assert (row["model"], row["expert"]) == (EXPERT, EXPERT) and _rows(served["db"], bare.id)[0]["expert"] is None


def test_chat_uses_the_template_and_n_choices(client, served):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hi there"}],
                                       max_tokens=5, n=2, seed=5, temperature=1.0)
    assert r.object == "chat.completion" and len(r.choices) == 2
    assert all(c.message.role == "assistant" for c in r.choices)
    rows = _rows(served["db"], r.id)
    assert [row["choice"] for row in rows] == [0, 1]
    assert rows[0]["prompt"] == "System: Be brief.\n\nUser: Hi there\n\nAssistant:"
    assert [row["completion"] for row in rows] == [c.message.content for c in r.choices]
    assert json.loads(rows[0]["params"])["messages"][1] == {"role": "user", "content": "Hi there"}
    same = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "Hi there"}],
                                          max_tokens=5, n=2, seed=5, temperature=1.0)
    assert [c.message.content for c in same.choices] == [c.message.content for c in r.choices]


def test_streamed_chat_equals_the_whole_answer(client, served):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=12,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].system_fingerprint == "dtrain-step-1"
    [row] = _rows(served["db"], chunks[0].id)
    assert row["completion"] == text


def test_streamed_completion_sends_done_after_the_chunks(served):
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{served['port']}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == _rows(served["db"], chunks[0]["id"])[0]["completion"]


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=2.5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=41), "max_tokens"),  # the node's --serve-max-tokens is 40 here
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=3), "n"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(logprobs=6), "logprobs"),
    (dict(echo=True), "echo"),
    (dict(prompt=[1, 2, 10**6]), "prompt"),
    (dict(prompt="word " * 80), "prompt"),  # 80 tokens: past the 64 positions
    (dict(prompt="word " * 40, max_tokens=30), "max_tokens"),  # fits alone, not with max_tokens
    (dict(seed=2**70), "seed"),
])
def test_bad_completion_requests_are_400_naming_the_field(client, kwargs, param):
    args = {"model": MODEL, "prompt": "Hello", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert e.value.status_code == 400
    assert set(e.value.body) == {"message", "type", "param", "code"} and e.value.body["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": None}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_bad_chat_requests_are_400(served, body, param):
    status, answer = _post(served, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"


def _post(served, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{served['port']}{path}", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_not_json_and_unknown_model(client, served):
    status, answer = _post(served, "/v1/completions", b"{not json")
    assert status == 400 and "JSON" in answer["error"]["message"]
    status, answer = _post(served, "/v1/completions", b"[1, 2]")
    assert status == 400
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_past_the_batch_and_queue_the_node_answers_429(client, served):
    # here the batch holds 2 sequences and nothing may wait: while a stream of n=2 decodes, a request is refused
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, n=2, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)  # decoding: both rows of the batch are taken
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert e.value.body["code"] == "queue_full" and e.value.body["type"] == "rate_limit_error"
    assert list(chunks)  # the stream goes on to its end
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0).choices  # room again


def test_feedback_sets_the_reward_of_the_recorded_rows(client, served):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}], max_tokens=3, n=2)
    token = r.model_extra["dtrain_feedback_token"]
    assert len(token) >= 32 and token not in {row["feedback_hash"] for row in _rows(served["db"], r.id)}
    answer = client.post("/feedback", body={"id": r.id, "reward": -0.5, "index": 1, "feedback_token": token},
                         cast_to=object)
    assert answer == {"id": r.id, "reward": -0.5, "index": 1, "updated": 1}
    assert [row["reward"] for row in _rows(served["db"], r.id)] == [None, -0.5]
    client.post("/feedback", body={"id": r.id, "reward": 1, "feedback_token": token}, cast_to=object)
    assert [row["reward"] for row in _rows(served["db"], r.id)] == [1.0, 1.0]
    other = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    other_token = other.model_extra["dtrain_feedback_token"]
    assert other_token != token
    for body, status in [({"id": r.id, "reward": 1.5, "feedback_token": token}, 400), ({"id": r.id}, 400),
                         ({"id": 5, "reward": 0, "feedback_token": token}, 400),
                         ({"id": r.id, "reward": float("nan"), "feedback_token": token}, 400),
                         ({"id": r.id, "reward": 0.1}, 400),  # no token
                         ({"id": r.id, "reward": 0.1, "feedback_token": 7}, 400),
                         ({"id": "cmpl-nope", "reward": 0.1, "feedback_token": token}, 404),
                         ({"id": r.id, "reward": 0.1, "index": 7, "feedback_token": token}, 404),
                         ({"id": r.id, "reward": -1, "feedback_token": other_token}, 403),  # another completion's
                         ({"id": r.id, "reward": -1, "index": 0, "feedback_token": token[:-1]}, 403)]:
        code, answer = _post(served, "/v1/feedback", json.dumps(body).encode())
        assert code == status and "error" in answer, (body, code, answer)
        if status == 403:
            assert answer["error"]["code"] == "feedback_forbidden" and answer["error"]["param"] == "feedback_token"
    assert [row["reward"] for row in _rows(served["db"], r.id)] == [1.0, 1.0]


def test_retention_keeps_the_newest_rows(client, served):
    ids = [client.completions.create(model=MODEL, prompt=f"count {i}", max_tokens=1).id for i in range(55)]
    with sqlite3.connect(served["db"]) as conn:
        assert conn.execute("SELECT COUNT(*) FROM completions").fetchone()[0] == 50  # --capture-max-rows here
    assert _rows(served["db"], ids[-1]) and _rows(served["db"], ids[-50])


def test_a_new_step_of_the_node_is_what_serves_next(client, served):  # last: it moves the node's step
    node = served["node"]
    before = client.completions.create(model=MODEL, prompt="To be", max_tokens=8, temperature=0, logprobs=0)
    rng = np.random.default_rng(0)
    sections = tuple(Section(t.id, None, rng.normal(scale=1.0, size=t.elements).astype(np.float32))
                     for t in node.tensors)
    node.submit(Contribution("test", node.step, 4, 3.0, sections))
    wait_until(lambda: node.step == 2, 60, "the update")
    after = client.completions.create(model=MODEL, prompt="To be", max_tokens=8, temperature=0, logprobs=0)
    assert (before.model_extra["dtrain_step"], after.model_extra["dtrain_step"]) == (1, 2)
    assert after.system_fingerprint == "dtrain-step-2" and client.models.list().data[0].model_extra["dtrain_step"] == 2
    # one AdamW step moves every weight a little: the model's probabilities moved with it
    assert after.choices[0].logprobs.token_logprobs[0] != before.choices[0].logprobs.token_logprobs[0]
    assert _rows(served["db"], after.id)[0]["step"] == 2
