"""Training API v1 conformance over real HTTP: every endpoint, status code and header of the spec and NOTES.md.

One node, in this process (`tests.inproc`: a real hivemind peer alone in its swarm, its app on a real port), serves
the whole module: `node` (--no-data: no batches handed out; min_nodes_for_update 1, target
batch 1: each accepted packet is one update). Nodes that hand out batches are in test_bridge_data.py.
"""
from __future__ import annotations

import http.client
import json
import math
import struct
import time

import numpy as np
import pytest

from dtrain.bridge import dgrd
from dtrain.bridge.training_routes import INLINE_INGEST_BYTES
from dtrain.node.assets import gpt2_tokenizer_files
from dtrain.node.config import ModelConfig
from dtrain.node.device import resolve, threads_now
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
# submissions


def test_submit_200_body(node):
    step = current_step(node)
    a = submit(node, small_packet(step))
    assert a.status == 200
    assert_plain_response(a)
    assert a.headers["Content-Type"].startswith("application/json")
    assert a.json() == {"ok": True, "message": "ok", "server_step": step}
    wait_step(node, step + 1)  # min_nodes_for_update 1, target batch 1: one update per packet


def _patched(data: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _malformed(step: int, elements) -> dict[str, tuple[bytes, str]]:
    """name -> (packet, a word its 400 message must hold); one per case of NOTES.md."""
    nid = b"conformance"
    tail = 16 + len(nid)  # offset of train_loss
    first = tail + 12  # offset of the first section
    good = small_packet(step)
    dense = dgrd.encode(step, "conformance", 1.0, 1, [(3, None, np.ones(elements[3], np.float32))])
    mode2 = dgrd.encode(step, "conformance", 1.0, 1, [(1, np.array([0, 1]), np.ones(2, np.float32))], flags=1)
    assert elements[2] <= 255  # a layer norm: one u8 skip reaches past its end
    small2 = dgrd.encode(step, "conformance", 1.0, 1, [(2, np.array([0]), np.ones(1, np.float32))], flags=1)

    def header(id_len, node_id):
        return struct.pack("<4sHHII", b"DGRD", 1, 0, step, id_len) + node_id + struct.pack("<fII", 1.0, 1, 0)

    return {
        "magic": (b"DGRX" + good[4:], "magic"),
        "version": (_patched(good, 4, "<H", 2), "version"),
        "flags": (_patched(good, 6, "<H", 2), "flags"),
        "truncated": (good[:-3], "truncated"),
        "truncated header": (good[:10], "truncated"),
        "empty": (b"", "truncated"),
        "truncated dense": (dense[:-2], "truncated"),
        "trailing": (good + b"\x00", "trailing"),
        "unknown tensor": (_patched(good, first, "<I", len(elements)), "unknown tensor"),
        "index mode 1": (_patched(good, first + 8, "<I", elements[1]), "index"),
        "index mode 2": (_patched(small2, first + 8, "<B", elements[2]), "index"),
        "twice": (dgrd.encode(step, "conformance", 1.0, 1, [(1, np.array([0]), np.ones(1)),
                                                           (1, np.array([1]), np.ones(1))]), "twice"),
        "samples 0": (_patched(good, tail + 4, "<I", 0), "samples"),
        "nan value": (_patched(good, first + 12, "<f", float("nan")), "not finite"),
        "inf value": (_patched(good, first + 12, "<f", float("inf")), "not finite"),
        "inf f16 value": (_patched(mode2, first + 9, "<e", float("inf")), "not finite"),
        "nan dense": (_patched(dense, first + 8, "<e", float("nan")), "not finite"),
        "nan loss": (_patched(good, tail, "<f", float("nan")), "train_loss"),
        "inf loss": (_patched(good, tail, "<f", float("-inf")), "train_loss"),
        "node_id empty": (header(0, b""), "node_id"),
        "node_id long": (header(257, b"x" * 257), "node_id"),
        "node_id utf8": (header(2, b"\xff\xfe"), "UTF-8"),
    }


def test_submit_400_every_malformed_case(node, elements):
    step = current_step(node)
    cases = _malformed(step, elements)
    # a malformed packet is 400 whatever its step: only well-formed packets are judged against the window
    cases["malformed and stale"] = (_patched(cases["twice"][0], 8, "<I", step + 100), "twice")
    for name, (packet, word) in cases.items():
        body = assert_error(submit(node, packet), 400, word)
        assert body["server_step"] == step, name
    assert current_step(node) == step


def _send_in_pieces(node, packet: bytes, pieces: int = 10, pause_s: float = 0.05) -> Answer:
    """POST `packet` a piece at a time, pausing between pieces: the node reads the first while the rest has not
    been sent."""
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
    try:
        conn.putrequest("POST", SUBMIT)
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(len(packet)))
        conn.endheaders()
        size = -(-len(packet) // pieces)
        for start in range(0, len(packet), size):
            conn.send(packet[start:start + size])
            time.sleep(pause_s)
        resp = conn.getresponse()
        return Answer(resp, resp.read())
    finally:
        conn.close()


def test_submit_a_large_packet_sent_in_pieces(node, elements):
    """A Mode 2 body of several MB (a huge-page body buffer, decoded on the executor) sent in pieces with pauses
    between them: a value that is not finite two thirds in is named as decode names it, and nothing is applied;
    without it the packet is accepted and makes one update."""
    step = current_step(node)
    rng = np.random.default_rng(3)
    idx = np.sort(rng.choice(elements[0], elements[0] * 9 // 10, replace=False))
    good = dgrd.encode(step, "large", 1.0, 1, [(1, np.array([0, 3]), np.ones(2)),
                                               (0, idx, rng.standard_normal(idx.size))], dgrd.FLAGS_MODE2)
    assert len(good) > INLINE_INGEST_BYTES  # the other packets of this module are decoded on the event loop
    bad = bytearray(good)
    # every exponent bit of an entry's value: the sparse bodies start at byte 1 mod 3 (33 + 8 + 6 + 8 = 55), so the
    # bytes at 0 mod 3 are the values' high bytes
    bad[len(good) * 2 // 3 // 3 * 3] |= 0x7C
    with pytest.raises(dgrd.PacketError) as expected:
        dgrd.decode(bytes(bad), elements)
    assert "not finite" in str(expected.value)
    body = assert_error(_send_in_pieces(node, bytes(bad)), 400, str(expected.value))
    assert body["server_step"] == step and current_step(node) == step
    a = _send_in_pieces(node, good)
    assert a.status == 200 and a.json()["server_step"] == step
    wait_step(node, step + 1)


def test_submit_409_stale_and_future(node):
    # drive the node to step >= 7 so that step - 6 is a valid u32
    while (step := current_step(node)) < 7:
        assert submit(node, small_packet(step)).status == 200
        wait_step(node, step + 1)
    for bad in (step - 6, step + 1, step + 1000, 0):
        body = assert_error(submit(node, small_packet(bad)), 409, "step mismatch")
        assert body["server_step"] == step
    assert current_step(node) == step
    # the edge of the late window is still accepted
    a = submit(node, small_packet(step - 5))
    assert a.status == 200 and a.json()["server_step"] == step
    wait_step(node, step + 1)


def test_submit_411_without_content_length(node):
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
    try:
        conn.request("POST", SUBMIT, body=iter([small_packet(1)]), encode_chunked=True,
                     headers={"Content-Type": "application/octet-stream", "Transfer-Encoding": "chunked"})
        resp = conn.getresponse()
        a = Answer(resp, resp.read())
    finally:
        conn.close()
    assert_error(a, 411, "Content-Length")


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


def test_submit_413_above_max_packet_bytes(node, elements):
    limit = dgrd.max_packet_bytes(elements)
    for length in (limit + 1, 10**12):
        assert_error(_headers_only(node, length), 413, str(length))


def test_submit_at_max_packet_bytes_is_not_413(node, elements):
    limit = dgrd.max_packet_bytes(elements)
    step = current_step(node)
    body = assert_error(submit(node, b"\x00" * limit), 400, "magic")
    assert body["server_step"] == step


# ---------------------------------------------------------------------------------------------
# CORS, framing, losses, status


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


def test_losses_and_status(node):
    info = node.get_json("/api/v1/model/info")
    losses = node.get_json("/api/v1/server/losses")
    assert isinstance(losses, list) and all(isinstance(x, float) for x in losses)
    assert len(losses) == info["updates"]
    status = node.get_json("/api/v1/swarm/status")
    assert status["step"] == info["step"] and status["updates"] == info["updates"]
    # an open swarm (no --swarm-key), in low-communication rounds with the sparse codec (the defaults): what the
    # dashboard tells its operator
    assert (status["closed"], status["sync"], status["wire_codec"]) == (False, "low-comm", "sparse")
    # where it computes: --device auto, the CPU on a machine without CUDA
    assert status["device"] == resolve("auto").as_dict()
    assert status["torch_threads"] == threads_now()  # no --torch-threads: torch's default, one per core


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
