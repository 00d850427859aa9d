"""The OpenAPI document against real nodes: every registered route is described, and every documented status of
every operation is answered by a real node to a real request of this module (and no other status is).

How the statuses are checked: two real nodes (`node`: started as `make node` starts it; `other`: --no-data, a
--split-model directory, contributor tokens, a two-packet rate limit, a 1 MiB pool and two contributors per update,
for the answers only such a node gives) get one request per documented (operation, status) from the table below.
Each answer is checked against its documented status and media type; then both nodes' /metrics are read, and the
set of (method, route template, status) their middleware counted in dtrain_http_requests_total must equal the
document's. This module needs no other test module, so it holds when
run alone; undocumented routes cannot reach a node at all: bridge.openapi refuses to start an app with one.
"""
from __future__ import annotations

import asyncio
import base64
import http.client
import json

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from dtrain.bridge import dgrd, openapi
from tests.nodeproc import REPO, TINY_CONFIG, wait_until
from tests.test_bridge_http import Answer, _start, current_step, small_packet
from tests.test_bridge_metrics import scrape

pytestmark = [pytest.mark.http, pytest.mark.timeout(300)]

TINY = json.loads(TINY_CONFIG.read_text())
TOKEN = "openapi-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    tmp = tmp_path_factory.mktemp("openapi")
    split_dir = tmp / "untied-gpt2"
    (tmp / "tokens").write_text(TOKEN + "\n")
    # an LM head apart from the embedding: /api/v1/split/lm_head then answers 200 (a tied head's answer is 404)
    GPT2LMHeadModel(GPT2Config(vocab_size=TINY["vocab_size"], n_positions=TINY["max_seq_len"], n_embd=TINY["d_model"],
                               n_layer=1, n_head=TINY["n_heads"], tie_word_embeddings=False)).save_pretrained(split_dir)
    capture = tmp_path_factory.mktemp("openapi-capture") / "capture.sqlite"
    # two contributors per update: a packet of one node_id waits in the 1 MiB pool, so its next one is the 503
    train = json.loads((REPO / "dtrain" / "static" / "train_config.json").read_text())
    (tmp / "train.json").write_text(json.dumps({**train, "min_nodes_for_update": 2}))
    started = {}
    try:
        # judges contributions against its own gradient (the default; tests turn it off): the 403 of a scored-out one
        started["node"] = _start("openapi", ["--model-config", str(TINY_CONFIG), "--target-batch-size", "1",
                                             "--capture-db", str(capture), "--reference-batch", "4"])
        # records nothing (no --capture-db), and decodes one sequence with nobody waiting: the /v1 answers 429 and feedback's 404
        started["other"] = _start("openapi-other", ["--model-config", str(TINY_CONFIG), "--no-data",
                                                    "--split-model", str(split_dir),
                                                    "--serve-max-batch", "1", "--serve-max-n", "1",
                                                    "--serve-queue", "0", "--contributor-tokens",
                                                    str(tmp / "tokens"), "--rate-limit", "0.001", "--rate-burst", "2",
                                                    "--train-config", str(tmp / "train.json"),
                                                    "--max-pending-mib", "1"])
        yield started
    finally:
        for proc in started.values():
            proc.kill()


def _send(node, method: str, path: str, body=None, headers=None, chunked=False, claim: int | None = None) -> Answer:
    """One request; `chunked` sends the body without Content-Length, `claim` declares a length and sends nothing."""
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)
    try:
        if claim is not None:
            conn.putrequest(method, path)
            conn.putheader("Content-Length", str(claim))
            conn.endheaders()
        elif chunked:
            conn.request(method, path, body=iter([body]), encode_chunked=True,
                         headers={"Transfer-Encoding": "chunked", **(headers or {})})
        else:
            conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return Answer(resp, resp.read())
    finally:
        conn.close()


def _forward(session_id: str = "openapi") -> bytes:
    hidden = np.zeros((2, TINY["d_model"]), "<f4")
    return json.dumps({"type": "forward", "hidden_states": base64.b64encode(hidden.tobytes()).decode(),
                       "seq_len": 2, "hidden_dim": TINY["d_model"], "session_id": session_id}).encode()


def _wte_packet(step: int, node_id: str) -> bytes:
    """Tensor 0 (the token embedding) dense: 3.2 MB of FP16."""
    return dgrd.encode(step, node_id, 1.5, 2, [(0, None, np.zeros(TINY["vocab_size"] * TINY["d_model"], np.float32))])


def _v1(body: dict, **options) -> dict:
    return {"body": json.dumps(body).encode(), "headers": {"Content-Type": "application/json"}, **options}


def _requests(step: int, other_step: int) -> list[tuple[str, str, str, dict, int]]:
    """(node, method, path, options for _send, expected status): one row per documented status."""
    json_h = {"Content-Type": "application/json"}
    model = TINY["name"]
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return [
        ("node", "GET", "/healthz", {}, 200),
        ("node", "GET", "/api/v1/model/info", {}, 200),
        ("node", "GET", "/api/v1/model/manifest", {}, 200),
        ("node", "GET", "/api/v1/model/tensor/0?format=f32&count=4", {}, 200),
        ("node", "GET", "/api/v1/model/tensor/zz", {}, 400),
        ("node", "GET", "/api/v1/model/tensor/99999", {}, 404),
        ("node", "GET", "/api/v1/model/tensor/0?offset=999999999", {}, 416),
        ("node", "POST", "/api/v1/train/submit", {"body": small_packet(step + 1)}, 409),
        ("node", "POST", "/api/v1/train/submit", {"body": small_packet(step)}, 200),
        ("node", "POST", "/api/v1/train/submit", {"body": b"junk"}, 400),
        ("node", "POST", "/api/v1/train/submit", {"body": small_packet(step), "chunked": True}, 411),
        ("node", "POST", "/api/v1/train/submit", {"claim": 10**12}, 413),
        ("other", "POST", "/api/v1/train/submit", {"body": small_packet(other_step)}, 401),  # closed: no token
        ("other", "POST", "/api/v1/train/submit", {"body": small_packet(other_step), "headers": {
            "Authorization": "Bearer not-a-token"}}, 401),
        # burst 2: the first packet of a node_id passes (3.2 MB into the empty 1 MiB pool, where it waits for a
        # second contributor); the next is within the rate but over the pool's bound; the third is over the rate
        ("other", "POST", "/api/v1/train/submit", {"body": _wte_packet(other_step, "eager"), "headers": BEARER}, 200),
        ("other", "POST", "/api/v1/train/submit", {"body": small_packet(other_step, "eager"), "headers": BEARER}, 503),
        ("other", "POST", "/api/v1/train/submit", {"body": small_packet(other_step, "eager"), "headers": BEARER}, 429),
        ("node", "GET", "/api/v1/server/losses", {}, 200),
        ("node", "GET", "/api/v1/data/batch?batch_size=2&seq_len=8", {}, 200),
        ("node", "GET", "/api/v1/data/batch?batch_size=0", {}, 400),
        ("other", "GET", "/api/v1/data/batch", {}, 404),
        ("node", "GET", "/api/v1/swarm/status", {}, 200),
        ("node", "GET", "/api/v1/contributors", {}, 200),
        ("node", "GET", "/api/v1/split/stream", {}, 400),  # a plain GET, no Upgrade; the 101 comes below
        ("node", "GET", "/api/v1/split/config", {}, 200),
        ("node", "POST", "/api/v1/split/forward", {"body": _forward(), "headers": json_h}, 200),
        ("node", "POST", "/api/v1/split/forward", {"body": b'{"type": "forward"}', "headers": json_h}, 400),
        ("node", "POST", "/api/v1/split/forward", {"body": _forward(), "chunked": True}, 411),
        ("node", "POST", "/api/v1/split/forward", {"claim": 10**12}, 413),
        ("node", "POST", "/api/v1/split/tokenize", {"body": b'{"text": "To be"}', "headers": json_h}, 200),
        ("node", "POST", "/api/v1/split/tokenize", {"body": b'{"text": 5}', "headers": json_h}, 400),
        ("node", "POST", "/api/v1/split/tokenize", {"body": b'{"text": "x"}', "chunked": True}, 411),
        ("node", "POST", "/api/v1/split/tokenize", {"claim": 10**12}, 413),
        ("other", "GET", "/api/v1/split/embedding?format=f16", {}, 200),
        ("other", "GET", "/api/v1/split/embedding?format=f64", {}, 400),
        ("node", "GET", "/api/v1/split/embedding", {}, 404),
        ("other", "GET", "/api/v1/split/lm_head?format=f32", {}, 200),
        ("other", "GET", "/api/v1/split/lm_head?format=f64", {}, 400),
        ("node", "GET", "/api/v1/split/lm_head", {}, 404),
        ("node", "GET", "/metrics", {}, 200),
        ("node", "GET", "/api/v1/openapi.json", {}, 200),
        ("node", "GET", "/static/model_config.json", {}, 200),
        ("node", "GET", "/static/train_config.json", {}, 200),
        ("node", "GET", "/static/trainer.js", {}, 200),
        ("node", "GET", "/static/no-such-file.js", {}, 404),
        ("node", "GET", "/", {}, 200),
        ("node", "GET", "/contribute", {}, 200),
        ("node", "GET", "/chat", {}, 200),
        ("node", "POST", "/v1/completions", _v1({"model": model, "prompt": "To be", "max_tokens": 2}), 200),
        ("node", "POST", "/v1/completions", _v1({"model": model, "prompt": "To be", "stream": True}), 200),
        ("node", "POST", "/v1/completions", _v1({"model": model, "prompt": "x", "temperature": 9}), 400),
        ("node", "POST", "/v1/completions", _v1({"model": "gpt-4o", "prompt": "x"}), 404),
        ("node", "POST", "/v1/completions", _v1({"model": model}, chunked=True), 411),
        ("node", "POST", "/v1/completions", {"claim": 10**12}, 413),
        ("node", "POST", "/v1/chat/completions", _v1(chat), 200),
        ("node", "POST", "/v1/chat/completions", _v1({**chat, "stream": True}), 200),
        ("node", "POST", "/v1/chat/completions", _v1({**chat, "messages": []}), 400),
        ("node", "POST", "/v1/chat/completions", _v1({**chat, "model": "gpt-4o"}), 404),
        ("node", "POST", "/v1/chat/completions", _v1(chat, chunked=True), 411),
        ("node", "POST", "/v1/chat/completions", {"claim": 10**12}, 413),
        ("node", "GET", "/v1/models", {}, 200),
        ("node", "GET", f"/v1/models/{model}", {}, 200),
        ("node", "GET", "/v1/models/gpt-4o", {}, 404),
        ("node", "POST", "/v1/feedback", _v1({"id": "cmpl-unknown", "reward": 2, "feedback_token": "t"}), 400),
        ("node", "POST", "/v1/feedback", _v1({"id": "cmpl-unknown", "reward": 1}), 400),  # no token
        ("node", "POST", "/v1/feedback", _v1({"id": "cmpl-unknown", "reward": 1, "feedback_token": "t"}), 404),
        ("other", "POST", "/v1/feedback", _v1({"id": "cmpl-any", "reward": 1, "feedback_token": "t"}), 404),
        ("node", "POST", "/v1/feedback", _v1({"id": "x", "reward": 1}, chunked=True), 411),
        ("node", "POST", "/v1/feedback", {"claim": 10**12}, 413),
    ]


def _documented_media(doc: dict, method: str, template: str, status: int) -> set[str]:
    response = doc["paths"][template][method.lower()]["responses"][str(status)]
    return set(response.get("content", {}))


def _documented_headers(doc: dict, method: str, template: str, status: int) -> set[str]:
    return set(doc["paths"][template][method.lower()]["responses"][str(status)].get("headers", {}))


def _template(path: str, doc: dict) -> str:
    """The documented path template a concrete path matches (literal paths first, as aiohttp routes them)."""
    path = path.split("?")[0]
    if path in doc["paths"]:
        return path
    for template in doc["paths"]:
        head, _, _ = template.partition("{")
        if "{" in template and path.startswith(head) and "/" not in path[len(head):]:
            return template
    raise AssertionError(f"{path} matches no documented path")


def _feedback(node) -> None:
    """The 200 and 403 of /v1/feedback: a reward for a completion this node just served, with the token it came with
    and with another."""
    served = json.loads(_send(node, "POST", "/v1/completions",
                              **_v1({"model": TINY["name"], "prompt": "Hi", "max_tokens": 1})).body)
    a = _send(node, "POST", "/v1/feedback", **_v1({"id": served["id"], "reward": 0.5, "feedback_token": "guess"}))
    assert a.status == 403 and json.loads(a.body)["error"]["code"] == "feedback_forbidden", a
    a = _send(node, "POST", "/v1/feedback", **_v1({"id": served["id"], "reward": 0.5,
                                                   "feedback_token": served["dtrain_feedback_token"]}))
    assert a.status == 200 and json.loads(a.body)["updated"] == 1


def _queue_full(node, path: str, body: dict) -> None:
    """The 429 of a /v1 route: while a stream holds the one sequence of a node that queues none, a request is
    refused; once the stream ends, the same request is served."""
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        held = conn.getresponse()
        assert held.status == 200
        assert held.readline().startswith(b"data: ")  # its first event: the sequence is decoding
        refused = _send(node, "POST", path, **_v1(body))
        held.read()
    finally:
        conn.close()
    assert refused.status == 429, refused
    assert _send(node, "POST", path, **_v1(body)).status == 200


def _upgrade(node) -> None:
    async def run():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(node.url + "/api/v1/split/stream") as ws:
                await ws.send_json({"type": "ping"})
                await ws.receive_json(timeout=30)
    asyncio.run(run())


def _scored_out(node) -> None:
    """Submit's 403: sign-flipped real gradients until the node's ledger scores their sender out."""
    from tests.test_reference_http import contributor, ledger, post, real_packet

    flipper = contributor(node, "openapi-flipper")
    step = current_step(node)
    for i in range(8):
        assert post(node, real_packet(flipper, step, lambda g: -g))[0] == 200
        wait_until(lambda: ledger(node)["openapi-flipper"]["disagreed"] == i + 1, 30, "the flipped packet judged")
    status, body = post(node, real_packet(flipper, step, lambda g: -g))
    assert status == 403 and "openapi-flipper" in body["message"], body


@pytest.mark.slow
def test_every_documented_status_is_answered_and_no_other(nodes):
    doc = nodes["node"].get_json("/api/v1/openapi.json")
    assert doc == openapi.document()
    for who, method, path, options, status in _requests(current_step(nodes["node"]), current_step(nodes["other"])):
        a = _send(nodes[who], method, path, **options)
        assert a.status == status, (who, method, path, a.status, a.body[:300])
        missing = {h for h in _documented_headers(doc, method, _template(path, doc), status) if h not in a.headers}
        assert not missing, (method, path, status, "documented headers not sent", missing)
        media = _documented_media(doc, method, _template(path, doc), status)
        if media and "*/*" not in media:
            assert a.headers["Content-Type"].split(";")[0] in media, (path, a.headers["Content-Type"], media)
        if a.headers["Content-Type"].startswith(openapi.JSON):
            json.loads(a.body)
    _scored_out(nodes["node"])  # submit's 403
    _upgrade(nodes["node"])  # the stream's 101
    _feedback(nodes["node"])
    model = TINY["name"]
    _queue_full(nodes["other"], "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 40, "temperature": 0})
    _queue_full(nodes["other"], "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 40, "temperature": 0})
    expected = {(m, path, int(s)) for m, path in openapi.operations(doc)
                for s in doc["paths"][path][m.lower()]["responses"] if s != "default"}

    def seen() -> set:
        answered = set()
        for proc in nodes.values():
            _, samples = scrape(proc)
            answered |= {(dict(labels)["method"], dict(labels)["route"], int(dict(labels)["status"]))
                         for (name, labels), value in samples.items()
                         if name == "dtrain_http_requests_total" and value > 0}
        return {s for s in answered if s[1] != "(unmatched)"}

    # a socket's 101 is counted when its handler returns, just after the close: read until it shows
    wait_until(lambda: ("GET", "/api/v1/split/stream", 101) in seen(), 10, "the socket's answer to be counted")
    answered = seen()
    assert expected - answered == set(), "documented but never answered"
    assert answered - expected == set(), "answered but not documented"


def test_undocumented_routes_are_found():
    app = web.Application()

    async def handler(request):
        return web.Response()
    app.router.add_get("/api/v1/model/tensor/{id}", handler)  # and its automatic HEAD
    app.router.add_get("/static/{name:.+}", handler)
    assert openapi.undocumented_routes(app, openapi.document()) == []
    app.router.add_post("/api/v1/model/tensor/{id}", handler)
    app.router.add_get("/api/v1/new", handler)
    assert openapi.undocumented_routes(app, openapi.document()) == ["GET /api/v1/new", "POST /api/v1/model/tensor/{id}"]
    with pytest.raises(openapi.OpenApiError, match="/api/v1/new"):
        asyncio.run(openapi._check(app))


def test_document_refs_resolve_and_operations_are_described():
    doc = openapi.document()

    def walk(value):
        if isinstance(value, dict):
            for k, v in value.items():
                if k == "$ref":
                    node = doc
                    for part in v.removeprefix("#/").split("/"):
                        node = node[part]  # KeyError: a dangling reference
                else:
                    walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
    walk(doc)
    assert doc["openapi"].startswith("3.")
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert op["summary"] and op["responses"], (method, path)
            for name in ("{id}", "{name}"):
                if name in path:
                    assert any(p["in"] == "path" for p in op["parameters"]), path
