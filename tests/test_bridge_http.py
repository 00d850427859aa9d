"""Training API v1 conformance over real HTTP: every endpoint, status code and header of the spec and NOTES.md, of the
model's routes (health, info, manifest, tensor downloads), CORS, framing and static files. Packet submission, and the
losses and status its updates report, are test_bridge_submit.py's.

One node, in this process (`tests.inproc`: a real hivemind peer alone in its swarm, its app on a real port), serves
the whole module: `node` (--no-data: no batches handed out; min_nodes_for_update 1, target
batch 1: each accepted packet is one update). Nodes that hand out batches are in test_bridge_data.py. The fixtures
and request functions here serve the other bridge test modules too.
"""
from __future__ import annotations

import http.client
import json
import math

import numpy as np
import pytest

from dtrain.bridge import dgrd
from dtrain.node.assets import gpt2_tokenizer_files
from dtrain.node.config import ModelConfig
from dtrain.node.model import build_model
from tests.inproc import InProcessNode
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until

pytestmark = [pytest.mark.http, pytest.mark.timeout(240)]

TRAIN_CONFIG = {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.99, "eps": 1e-07, "weight_decay": 0.05,
                "min_nodes_for_update": 1}
SUBMIT = "/api/v1/train/submit"
CORS_ORIGIN = ("Access-Control-Allow-Origin", "*")


# ---------------------------------------------------------------------------------------------
# fixtures and helpers


def _start(name: str, args) -> InProcessNode:
    return InProcessNode(name, args, new_run_id())


@pytest.fixture(scope="module")
def train_config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("http") / "train.json"
    path.write_text(json.dumps(TRAIN_CONFIG))
    return path


@pytest.fixture(scope="module")
def node(train_config_file):
    proc = _start("http", ["--model-config", str(TINY_CONFIG), "--target-batch-size", "1",
                           "--train-config", str(train_config_file), "--no-data"])
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def manifest(node):
    return node.get_json("/api/v1/model/manifest")


@pytest.fixture(scope="module")
def elements(manifest):
    return [t["elements"] for t in manifest["tensors"]]


class Answer:
    def __init__(self, resp: http.client.HTTPResponse, body: bytes):
        self.status, self.headers, self.body = resp.status, resp.headers, body

    def json(self):
        return json.loads(self.body)


def request(node, method: str, path: str, body=None, headers=None) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return Answer(resp, resp.read())
    finally:
        conn.close()


def submit(node, packet: bytes) -> Answer:
    return request(node, "POST", SUBMIT, packet, {"Content-Type": "application/octet-stream"})


def _headers_only(node, length: int) -> Answer:
    """A POST that declares `length` body bytes and sends none: the answer must come from the headers alone."""
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
    try:
        conn.putrequest("POST", SUBMIT)
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        resp = conn.getresponse()
        return Answer(resp, resp.read())
    finally:
        conn.close()


def assert_plain_response(a: Answer) -> None:
    """Spec: every response has Content-Length and none is chunked."""
    assert a.headers.get("Transfer-Encoding") is None
    assert a.headers.get("Content-Length") is not None
    assert int(a.headers["Content-Length"]) == len(a.body)
    assert a.headers.get("Access-Control-Allow-Origin") == "*"


def assert_error(a: Answer, status: int, *words: str) -> dict:
    assert a.status == status, (a.status, a.body)
    assert_plain_response(a)
    body = a.json()
    assert body["ok"] is False
    for word in words:
        assert word in body["message"], (word, body["message"])
    return body


def current_step(node) -> int:
    return node.get_json("/api/v1/model/info")["step"]


def small_packet(step: int, node_id="conformance", **kw) -> bytes:
    args = dict(train_loss=1.5, samples=2, sections=[(1, np.array([0, 3]), np.array([0.25, -0.5], np.float32))])
    args.update(kw)
    return dgrd.encode(step, node_id, **args)


def wait_step(node, step: int) -> None:
    wait_until(lambda: current_step(node) >= step, 30, f"step {step}", interval_s=0.05)


# ---------------------------------------------------------------------------------------------
# health, info, manifest


def test_healthz(node):
    a = request(node, "GET", "/healthz")
    assert a.status == 200
    assert a.headers["Content-Type"].startswith("application/json")
    assert a.json() == {"ok": True}
    assert_plain_response(a)


def test_model_info_fields_and_types(node, elements):
    a = request(node, "GET", "/api/v1/model/info")
    assert a.status == 200
    assert_plain_response(a)
    info = a.json()
    assert set(info) >= {"step", "updates", "total_params", "config", "train"}
    assert type(info["step"]) is int and type(info["updates"]) is int and type(info["total_params"]) is int
    assert info["step"] == info["updates"] + 1
    assert info["total_params"] == sum(elements)
    tiny = json.loads(TINY_CONFIG.read_text())
    keys = ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len")
    assert info["config"] == {k: tiny[k] for k in keys}
    assert all(type(info["config"][k]) is int for k in keys)
    assert info["train"] == {**TRAIN_CONFIG, "max_samples_per_packet": 256}  # NOTES.md, "Swarm soundness"
    for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay"):
        assert isinstance(info["train"][k], float)
    assert type(info["train"]["min_nodes_for_update"]) is int


def test_manifest_entries(node, manifest):
    assert type(manifest["step"]) is int and manifest["step"] >= 1
    model = build_model(ModelConfig.load(TINY_CONFIG))
    params = list(model.named_parameters())
    tensors = manifest["tensors"]
    assert [t["id"] for t in tensors] == list(range(len(params)))
    for t, (name, p) in zip(tensors, params):
        assert t["name"] == name
        assert t["shape"] == list(p.shape)
        assert t["elements"] == math.prod(t["shape"]) == p.numel()
        assert t["bytes_f32"] == 4 * t["elements"]
        assert t["bytes_f16"] == 2 * t["elements"]


# ---------------------------------------------------------------------------------------------
# tensor downloads


def test_every_tensor_f16_equals_f32_converted(node, manifest):
    for t in manifest["tensors"]:
        f32 = request(node, "GET", f"/api/v1/model/tensor/{t['id']}?format=f32")
        f16 = request(node, "GET", f"/api/v1/model/tensor/{t['id']}?format=f16")
        default = request(node, "GET", f"/api/v1/model/tensor/{t['id']}")
        for a, fmt in ((f32, "f32"), (f16, "f16"), (default, "f16")):
            assert a.status == 200
            assert_plain_response(a)
            assert a.headers["Content-Type"] == "application/octet-stream"
            assert a.headers["X-Tensor-Id"] == str(t["id"])
            assert a.headers["X-Tensor-Offset"] == "0"
            assert a.headers["X-Tensor-Count"] == str(t["elements"])
            assert a.headers["X-Tensor-Format"] == fmt
            assert int(a.headers["X-Model-Step"]) >= 1
        assert len(f32.body) == t["bytes_f32"] and len(f16.body) == t["bytes_f16"]
        assert f16.body == default.body
        if f32.headers["X-Model-Step"] == f16.headers["X-Model-Step"]:
            assert np.frombuffer(f32.body, "<f4").astype("<f2").tobytes() == f16.body


@pytest.mark.parametrize("query, offset, count", [
    ("offset=0&count=1", 0, 1),
    ("offset=5&count=10", 5, 10),
    ("offset=7", 7, None),
    ("count=3", 0, 3),
    ("offset=END", "END", 0),
    ("offset=END&count=0", "END", 0),
])
def test_tensor_slices(node, manifest, query, offset, count):
    t = manifest["tensors"][0]
    n = t["elements"]
    offset = n if offset == "END" else offset
    count = n - offset if count is None else count
    query = query.replace("END", str(n))
    full = request(node, "GET", "/api/v1/model/tensor/0?format=f32")
    for fmt, size in (("f32", 4), ("f16", 2)):
        a = request(node, "GET", f"/api/v1/model/tensor/0?format={fmt}&{query}")
        assert a.status == 200
        assert_plain_response(a)
        assert a.headers["X-Tensor-Offset"] == str(offset)
        assert a.headers["X-Tensor-Count"] == str(count)
        assert a.headers["X-Tensor-Format"] == fmt
        assert len(a.body) == count * size
        if fmt == "f32" and a.headers["X-Model-Step"] == full.headers["X-Model-Step"]:
            assert a.body == full.body[offset * 4:(offset + count) * 4]


@pytest.mark.parametrize("path, word", [
    ("/api/v1/model/tensor/abc", "tensor id"),
    ("/api/v1/model/tensor/1.5", "tensor id"),
    ("/api/v1/model/tensor/0?format=f64", "format"),
    ("/api/v1/model/tensor/0?format=F16", "format"),
    ("/api/v1/model/tensor/0?offset=-1", "offset"),
    ("/api/v1/model/tensor/0?offset=x", "offset"),
    ("/api/v1/model/tensor/0?offset=1.0", "offset"),
    ("/api/v1/model/tensor/0?count=x", "count"),
    ("/api/v1/model/tensor/0?count=2.5", "count"),
    ("/api/v1/model/tensor/0?count=-3", "count"),
])
def test_tensor_400(node, path, word):
    assert_error(request(node, "GET", path), 400, word)


def test_tensor_404(node, manifest):
    n = len(manifest["tensors"])
    for tid in (n, n + 1, 10**9, -1):
        assert_error(request(node, "GET", f"/api/v1/model/tensor/{tid}"), 404, str(tid))


def test_tensor_416(node, manifest):
    n = manifest["tensors"][2]["elements"]
    for query in (f"offset={n + 1}", f"offset={n + 1}&count=0", f"offset=0&count={n + 1}",
                  f"offset={n - 2}&count=3", f"offset={n}&count=1"):
        assert_error(request(node, "GET", f"/api/v1/model/tensor/2?{query}"), 416)


# ---------------------------------------------------------------------------------------------
# CORS, framing, static files


def test_cors_on_success_and_errors(node):
    answers = [
        request(node, "GET", "/healthz"),
        request(node, "GET", "/api/v1/model/tensor/0?count=1"),
        request(node, "GET", "/api/v1/model/tensor/99999"),
        request(node, "GET", "/api/v1/model/tensor/zz"),
        request(node, "GET", "/api/v1/model/tensor/0?offset=99999999"),
        submit(node, b"junk"),
        submit(node, small_packet(current_step(node) + 1)),
        _headers_only(node, 10**12),
        request(node, "GET", "/no/such/route"),
    ]
    assert [a.status for a in answers] == [200, 200, 404, 400, 416, 400, 409, 413, 404]
    for a in answers:
        assert a.headers.get("Access-Control-Allow-Origin") == "*"
        assert "X-Model-Step" in a.headers.get("Access-Control-Expose-Headers", "")


def test_unknown_route_and_method(node):
    assert_error(request(node, "GET", "/api/v1/nothing"), 404)
    assert_error(request(node, "GET", SUBMIT), 405)


def test_options_preflight(node):
    for path in (SUBMIT, "/api/v1/model/tensor/0"):
        a = request(node, "OPTIONS", path, headers={
            "Origin": "http://example.org", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert a.status in (200, 204)
        assert a.body == b""
        assert a.headers.get("Transfer-Encoding") is None
        assert a.headers["Access-Control-Allow-Origin"] == "*"
        methods = {m.strip() for m in a.headers["Access-Control-Allow-Methods"].split(",")}
        assert {"GET", "POST", "OPTIONS"} <= methods
        allowed = {h.strip().lower() for h in a.headers["Access-Control-Allow-Headers"].split(",")}
        assert "content-type" in allowed


@pytest.mark.parametrize("path", [
    "/healthz", "/api/v1/model/info", "/api/v1/model/manifest", "/api/v1/model/tensor/0",
    "/api/v1/model/tensor/0?format=f32", "/api/v1/server/losses", "/api/v1/swarm/status",
    "/api/v1/data/batch", "/static/vocab.json", "/static/merges.txt", "/static/model_config.json",
    "/static/train_config.json", "/static/no-such-file",
])
def test_no_chunked_responses(node, path):
    assert_plain_response(request(node, "GET", path))


def test_static_configs_are_the_loaded_ones(node):
    a = request(node, "GET", "/static/model_config.json")
    assert a.status == 200 and a.headers["Content-Type"].startswith("application/json")
    assert a.json() == json.loads(TINY_CONFIG.read_text())
    a = request(node, "GET", "/static/train_config.json")
    assert a.status == 200
    assert a.json() == TRAIN_CONFIG


def test_static_vocab(node):
    a = request(node, "GET", "/static/vocab.json")
    assert a.status == 200
    assert a.body == gpt2_tokenizer_files().vocab.read_bytes()
    assert len(a.json()) == 50257


# ---------------------------------------------------------------------------------------------
# data batches


def test_data_batch_404_without_dataset(node):
    assert_error(request(node, "GET", "/api/v1/data/batch"), 404, "--train-data")


def test_pages_and_static_files_are_cross_origin_isolated(node):
    for path in ("/", "/contribute", "/chat", "/static/trainer.js", "/static/contribute_worker.js"):
        a = request(node, "GET", path)
        assert a.status == 200, path
        assert a.headers["Cross-Origin-Opener-Policy"] == "same-origin", path
        assert a.headers["Cross-Origin-Embedder-Policy"] == "require-corp", path


def test_static_missing_file_is_a_plain_404(node):
    assert_error(request(node, "GET", "/static/no-such-file.js"), 404, "no-such-file.js")
    assert_error(request(node, "GET", "/static/%2e%2e/pyproject.toml"), 404)
    assert_error(request(node, "GET", "/static/"), 404)
