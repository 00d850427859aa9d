"""Untrusted contributors against a real node over HTTP: the issue's attack packet, the samples cap, rate limits,
contributor tokens and the ledger. A closed node (contributor tokens) with a low rate limit serves the module."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from bridge import dgrd
from tests.nodeproc import TINY_CONFIG, NodeProcess, new_run_id, wait_until
from tests.test_bridge_semantics import download_f32

pytestmark = pytest.mark.timeout(240)

TOKEN = "s3cret-token"
TRAIN = {"learning_rate": 0.001, "weight_decay": 0.0, "min_nodes_for_update": 2}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("untrusted")
    (tmp / "tokens").write_text(f"# contributors\n{TOKEN}\n")
    (tmp / "train.json").write_text(json.dumps(TRAIN))
    proc = NodeProcess("untrusted", ["--model-config", str(TINY_CONFIG), "--train-config", str(tmp / "train.json"),
                                     "--contributor-tokens", str(tmp / "tokens"), "--rate-limit", "0.2",
                                     "--rate-burst", "2"], new_run_id())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


def post(node, packet: bytes, token: str | None = TOKEN):
    headers = {"Content-Type": "application/octet-stream"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(node.url + "/api/v1/train/submit", data=packet, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _step(node) -> int:
    return node.get_json("/api/v1/model/info")["step"]


def test_a_token_is_required_and_nothing_applies_without_one(node):
    packet = dgrd.encode(_step(node), "no-token", 3.0, 4, [(1, np.array([0]), np.array([1.0], np.float32))])
    for token in (None, "wrong"):
        status, body, _ = post(node, packet, token=token)
        assert status == 401 and not body["ok"] and "token" in body["message"]
    assert node.status()["pending_contributors"] == 0 and node.status()["accepted_packets"] == 0


def test_the_attack_packet_leaves_a_finite_model_moved_by_at_most_the_learning_rate(node):
    manifest = node.get_json("/api/v1/model/manifest")["tensors"]
    step, before = download_f32(node, manifest)
    huge = dgrd.encode(step, "attacker", 3.0, 2**32 - 1, [(0, np.array([1, 2, 3]), np.full(3, 3e38, np.float32))])
    status, body, _ = post(node, huge)
    assert status == 400 and "256" in body["message"]  # the cap, named; nothing applied
    info = node.get_json("/api/v1/model/info")
    assert info["train"]["max_samples_per_packet"] == 256 and info["step"] == step
    # under the cap, the same values: accepted, then bounded by the aggregation
    attack = dgrd.encode(step, "attacker", 3.0, 256, [(0, np.array([1, 2, 3]), np.full(3, 3e38, np.float32))])
    rng = np.random.default_rng(0)
    honest = dgrd.encode(step, "honest", 3.0, 4, [(0, None, rng.normal(0, 0.01, manifest[0]["elements"]))])
    assert post(node, attack)[0] == 200 and post(node, honest)[0] == 200
    wait_until(lambda: _step(node) == step + 1, 60, "the update")
    _, after = download_f32(node, manifest)
    assert all(np.isfinite(a).all() for a in after)
    # weight decay 0: one AdamW step moves a coordinate by lr * |m_hat| / (sqrt(v_hat) + eps) <= lr
    moved = max(float(np.abs(a - b).max()) for a, b in zip(after, before))
    assert 0 < moved <= TRAIN["learning_rate"] * (1 + 1e-5)
    losses = node.get_json("/api/v1/server/losses")
    assert losses and all(np.isfinite(losses))
    ledger = {r["node_id"]: r for r in node.get_json("/api/v1/contributors")["contributors"]}
    assert ledger["attacker"]["rejected"] == {"samples_cap": 1} and ledger["attacker"]["accepted"] == 1
    assert ledger["attacker"]["outliers"] == 1 and ledger["honest"]["outliers"] == 0


def test_a_contributor_over_its_rate_gets_429_with_retry_after(node):
    step = _step(node)
    packet = dgrd.encode(step, "eager", 3.0, 1, [(1, np.array([5]), np.array([0.1], np.float32))])
    answers = [post(node, packet) for _ in range(3)]  # burst 2
    assert [a[0] for a in answers[:2]] == [200, 200]
    status, body, headers = answers[2]
    assert status == 429 and float(headers["Retry-After"]) > 0 and "eager" in body["message"]
    record = {r["node_id"]: r for r in node.get_json("/api/v1/contributors")["contributors"]}["eager"]
    assert record["accepted"] == 2 and record["rejected"] == {"rate_limited": 1}
