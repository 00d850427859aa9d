"""GET /metrics of a real node over HTTP, parsed by prometheus_client's own parser: every family is there with its
type, the node's numbers equal /api/v1/swarm/status, and the bridge's counters count exactly the requests made."""
from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.nodeproc import TINY_CONFIG, wait_until
from tests.test_bridge_http import (SUBMIT, _headers_only, _start, assert_plain_response, current_step,
                                    request, small_packet, submit, wait_step)

pytestmark = [pytest.mark.http, pytest.mark.timeout(240)]

FAMILIES = {
    "dtrain_step": "gauge", "dtrain_updates": "counter", "dtrain_peers": "gauge", "dtrain_contributors": "gauge",
    "dtrain_samples": "counter", "dtrain_pending_contributors": "gauge", "dtrain_split_sessions": "gauge",
    "dtrain_split_sockets": "gauge", "dtrain_http_requests": "counter", "dtrain_packets_accepted": "counter",
    "dtrain_packets_rejected": "counter", "dtrain_ingest_bytes": "counter", "dtrain_download_bytes": "counter",
    "dtrain_split_forward_seconds": "histogram", "dtrain_update_duration_seconds": "histogram",
    "dtrain_serve_sequences": "gauge", "dtrain_serve_waiting": "gauge", "dtrain_serve_requests": "counter",
    "dtrain_serve_tokens": "counter",
}
D_MODEL = json.loads(TINY_CONFIG.read_text())["d_model"]


@pytest.fixture(scope="module")
def node():
    proc = _start("metrics", ["--model-config", str(TINY_CONFIG), "--target-batch-size", "1"])
    try:
        yield proc
    finally:
        proc.kill()


def scrape(node) -> tuple[dict, dict]:
    """({family name: type}, {(sample name, sorted labels): value}) of one GET /metrics."""
    a = request(node, "GET", "/metrics")
    assert a.status == 200
    assert_plain_response(a)
    assert a.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    types, samples = {}, {}
    for family in text_string_to_metric_families(a.body.decode()):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _forward_body(session_id: str) -> bytes:
    hidden = np.zeros((3, D_MODEL), "<f4")
    return json.dumps({"type": "forward", "hidden_states": base64.b64encode(hidden.tobytes()).decode(),
                       "seq_len": 3, "hidden_dim": D_MODEL, "session_id": session_id}).encode()


def test_families_and_types(node):
    types, samples = scrape(node)
    for name, kind in FAMILIES.items():
        assert types.get(name) == kind, (name, types.get(name))
    # label sets a dashboard plots exist from the start, at zero
    assert (("dtrain_packets_rejected_total", (("reason", "step_mismatch"), ("status", "409"))) in samples)
    assert value(samples, "dtrain_download_bytes_total", format="f32") >= 0
    assert value(samples, "dtrain_update_duration_seconds_count") == 0  # its hook is the node side's to call


def test_counters_count_exactly_what_was_asked(node):
    _, before = scrape(node)
    manifest = node.get_json("/api/v1/model/manifest")["tensors"]
    assert request(node, "GET", "/api/v1/model/tensor/0").status == 200
    assert request(node, "GET", "/api/v1/model/tensor/1?format=f32&count=10").status == 200
    assert request(node, "GET", "/api/v1/model/tensor/99999").status == 404

    step = current_step(node)
    good = small_packet(step, node_id="metrics-a")
    stale = small_packet(step + 1, node_id="metrics-b")
    assert submit(node, good).status == 200
    assert submit(node, b"junk").status == 400
    assert submit(node, stale).status == 409
    assert _headers_only(node, 10**12).status == 413
    wait_step(node, step + 1)
    assert request(node, "GET", "/no/such/route").status == 404
    assert request(node, "GET", SUBMIT).status == 405

    _, after = scrape(node)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("dtrain_download_bytes_total", format="f16") == manifest[0]["elements"] * 2
    assert grew("dtrain_download_bytes_total", format="f32") == 10 * 4
    assert grew("dtrain_packets_accepted_total") == 1
    assert grew("dtrain_packets_rejected_total", status="400", reason="malformed") == 1
    assert grew("dtrain_packets_rejected_total", status="409", reason="step_mismatch") == 1
    assert grew("dtrain_packets_rejected_total", status="413", reason="too_large") == 1
    assert grew("dtrain_ingest_bytes_total") == len(good) + len(b"junk") + len(stale)  # not the 413's claim
    route = "/api/v1/model/tensor/{id}"
    assert grew("dtrain_http_requests_total", method="GET", route=route, status="200") == 2
    assert grew("dtrain_http_requests_total", method="GET", route=route, status="404") == 1
    assert grew("dtrain_http_requests_total", method="POST", route=SUBMIT, status="409") == 1
    assert grew("dtrain_http_requests_total", method="GET", route="(unmatched)", status="404") == 1
    assert grew("dtrain_http_requests_total", method="GET", route="(unmatched)", status="405") == 1


def test_serve_counts_requests_and_tokens(node):
    _, before = scrape(node)
    body = json.dumps({"model": json.loads(TINY_CONFIG.read_text())["name"], "prompt": "Hi", "max_tokens": 5,
                       "n": 2, "temperature": 0}).encode()
    a = request(node, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert a.status == 200
    usage, choices = a.json()["usage"], a.json()["choices"]
    _, after = scrape(node)
    assert value(after, "dtrain_serve_requests_total") - value(before, "dtrain_serve_requests_total") == 1
    # every token sampled: the completion's, and an end-of-text for each choice that stopped (no stop sequences)
    ended = sum(c["finish_reason"] == "stop" for c in choices)
    assert value(after, "dtrain_serve_tokens_total") - value(before, "dtrain_serve_tokens_total") == \
        usage["completion_tokens"] + ended
    assert value(after, "dtrain_serve_sequences") == value(after, "dtrain_serve_waiting") == 0


def test_node_numbers_equal_swarm_status(node):
    step = current_step(node)
    assert submit(node, small_packet(step, node_id="metrics-c")).status == 200
    wait_step(node, step + 1)
    status = node.status()
    _, samples = scrape(node)
    assert value(samples, "dtrain_step") == status["step"]
    assert value(samples, "dtrain_updates_total") == status["updates"] >= 1
    assert value(samples, "dtrain_peers") == status["peers"] == 1
    assert value(samples, "dtrain_contributors") == status["contributors"] >= 1
    assert value(samples, "dtrain_samples_total") == status["samples_total"]
    assert value(samples, "dtrain_pending_contributors") == status["pending_contributors"]


def test_split_sessions_sockets_and_forward_latency(node):
    async def run():
        async with aiohttp.ClientSession() as session:
            async with session.post(node.url + "/api/v1/split/forward", data=_forward_body("metrics-s1")) as r:
                assert r.status == 200, await r.text()
            async with session.ws_connect(node.url + "/api/v1/split/stream") as ws:
                await ws.send_json({"type": "ping"})
                await ws.receive_json(timeout=30)
                await ws.send_str(_forward_body("metrics-s2").decode())  # a WebSocket forward: timed as "ws"
                assert (await ws.receive_json(timeout=30))["type"] == "forward"
                await ws.send_json({"type": "forward"})  # an error answer: not a forward, not timed
                assert (await ws.receive_json(timeout=30))["type"] == "error"
                return await asyncio.get_running_loop().run_in_executor(None, scrape, node)

    _, during = asyncio.run(run())
    assert value(during, "dtrain_split_sockets") == 1
    assert value(during, "dtrain_split_sessions") == 2
    assert value(during, "dtrain_split_forward_seconds_count", transport="ws") == 1
    assert value(during, "dtrain_split_forward_seconds_sum", transport="ws") > 0
    assert value(during, "dtrain_split_forward_seconds_count", transport="http") == 1
    assert value(during, "dtrain_split_forward_seconds_bucket", transport="http", le="+Inf") == 1
    assert value(during, "dtrain_split_forward_seconds_sum", transport="http") > 0
    wait_until(lambda: value(scrape(node)[1], "dtrain_split_sockets") == 0, 10, "the socket to be closed")
