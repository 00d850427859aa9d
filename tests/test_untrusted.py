"""Untrusted contributors against a real node over HTTP: every attack docs/robustness.md lists as real DGRD packets (finite
parameters, movement within one AdamW step's exact bound, the ledger's counts), the samples cap, rate limits and
contributor tokens. One closed node (contributor tokens, a low rate limit) serves the whole module; every test
uses node_ids of its own, so the per-node_id rate limit only meets the test that is about it."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from dtrain.bridge import dgrd
from tests.adamw import gpt2_adamw
from tests.inproc import InProcessNode
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until
from tests.test_bridge_semantics import download_f32

pytestmark = [pytest.mark.http, pytest.mark.timeout(240)]

TOKEN = "s3cret-token"
# AdamW's settings, all explicit: the movement bound is computed from them. Four contributors per hand-over (three
# honest, one attacker) so the hand-over's own medians take part, as they do with browsers in numbers.
TRAIN = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1,
         "min_nodes_for_update": 4}
GRAD_SCALE = 0.01  # size of the honest gradients' entries (and of their noise)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("untrusted")
    (tmp / "tokens").write_text(f"# contributors\n{TOKEN}\n")
    (tmp / "train.json").write_text(json.dumps(TRAIN))
    proc = InProcessNode("untrusted", ["--model-config", str(TINY_CONFIG), "--train-config", str(tmp / "train.json"),
                                     "--no-data", "--contributor-tokens", str(tmp / "tokens"), "--rate-limit", "0.2",
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


# ---------------------------------------------------------------------------------------------------------
# every attack of the issue, one hand-over each: three honest contributors and one attacker


def adamw_ratio_bound(t: int, beta1: float, beta2: float) -> float:
    """The largest |m_hat_t| / sqrt(v_hat_t) any gradient sequence can give AdamW at its step t.

    m_t = (1 - b1) sum_k b1^(t-k) g_k and v_t = (1 - b2) sum_k b2^(t-k) g_k^2; Cauchy-Schwarz on
    sum_k (b1^(t-k) / b2^((t-k)/2)) (b2^((t-k)/2) g_k) gives
    |m_t| <= (1 - b1) sqrt(sum_j (b1^2/b2)^j) sqrt(v_t / (1 - b2)), with equality for one choice of the g_k;
    bias correction multiplies by sqrt(1 - b2^t) / (1 - b1^t). At t = 1 it is 1.
    """
    r = beta1 ** 2 / beta2
    return ((1 - beta1) / np.sqrt(1 - beta2) * np.sqrt((1 - r ** t) / (1 - r))
            * np.sqrt(1 - beta2 ** t) / (1 - beta1 ** t))


def assert_one_adamw_step(before: list[np.ndarray], after: list[np.ndarray], t: int) -> None:
    """Finite, and each coordinate moved by at most lr * wd * |p| (decoupled decay, applied first) plus
    lr * adamw_ratio_bound(t) (eps only shrinks the Adam term); float32 rounding of both terms allowed."""
    lr, wd = TRAIN["learning_rate"], TRAIN["weight_decay"]
    adam = lr * adamw_ratio_bound(t, TRAIN["beta1"], TRAIN["beta2"])
    f32 = float(np.finfo(np.float32).eps)
    for tid, (b, a) in enumerate(zip(before, after)):
        assert np.isfinite(a).all(), f"tensor {tid} is not finite"
        b64, a64 = b.astype(np.float64), a.astype(np.float64)
        bound = lr * wd * np.abs(b64) + adam
        slack = 4 * f32 * (np.abs(b64) + adam)
        over = np.abs(a64 - b64) - bound - slack
        assert (over <= 0).all(), f"tensor {tid}: a coordinate moved {over.max():.3g} past the AdamW bound"
    moved = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(after, before))
    assert moved > 0.1 * lr, "the update did not move the parameters"


def honest_sections(rng, support, truth) -> list:
    """One honest gradient: the hand-over's true direction plus as much batch noise (signal-to-noise 1)."""
    return [(tid, idx, (g + rng.normal(0, GRAD_SCALE, g.size)).astype(np.float32))
            for tid, idx, g in zip(range(len(support)), support, truth)]


def attack_packets(attack: str, step: int, rng, support, truth, honest: list[list]) -> list[tuple[bytes, int]]:
    """The attacker's packets, each with the status it must get."""
    mine = honest_sections(rng, support, truth)  # what the attacker computed honestly
    flip = [(tid, idx, -v) for tid, idx, v in mine]
    if attack == "sign_flip":
        return [(dgrd.encode(step, attack, 3.0, 4, flip), 200)]
    if attack == "scaled_x1000":
        return [(dgrd.encode(step, attack, 3.0, 4, [(tid, idx, 1000 * v) for tid, idx, v in mine]), 200)]
    if attack == "noise":
        return [(dgrd.encode(step, attack, 3.0, 4, [(tid, idx, rng.normal(0, 1, idx.size).astype(np.float32))
                                                    for tid, idx, _ in mine]), 200)]
    if attack == "huge_samples":  # above the cap: refused whole; at the cap: accepted, weighted as claimed
        return [(dgrd.encode(step, attack, 3.0, 2**32 - 1, flip), 400),
                (dgrd.encode(step, attack, 3.0, 256, flip), 200)]
    if attack == "little_is_enough":  # Baruch et al. 2019: mean - z std of the honest packets, coordinate-wise
        values = np.stack([np.concatenate([v for _, _, v in h]) for h in honest])
        shifted = values.mean(axis=0) - 1.0 * values.std(axis=0)
        ends = np.cumsum([0] + [idx.size for idx in support])
        return [(dgrd.encode(step, attack, 3.0, 4, [(tid, idx, shifted[ends[tid]:ends[tid + 1]].astype(np.float32))
                                                    for tid, idx in enumerate(support)]), 200)]
    if attack == "huge_values":  # the packet: 3e38 on three coordinates, the most samples allowed
        return [(dgrd.encode(step, attack, 3.0, 256, [(0, np.array([1, 2, 3]), np.full(3, 3e38, np.float32))]), 200)]
    raise ValueError(attack)


# attack -> (the attacker's ledger outliers, rejected); every attacker has exactly one packet accepted
EXPECTED = {
    "sign_flip": (0, {}),  # an honest norm, as far from the mean as an honest packet: not told apart (docs/robustness.md)
    "scaled_x1000": (1, {}),  # norm-clipped
    "noise": (1, {}),  # norm-clipped
    "huge_samples": (1, {"samples_cap": 1}),  # above the cap: 400; at it: counted as 4x the hand-over's median (4)
    "little_is_enough": (0, {}),  # inside the honest spread by design
    "huge_values": (1, {}),  # norm-clipped
}


@pytest.mark.parametrize("attack", list(EXPECTED))
def test_an_attack_leaves_finite_parameters_moved_by_at_most_one_adamw_step(node, attack):
    manifest = node.get_json("/api/v1/model/manifest")["tensors"]
    step, before = download_f32(node, manifest)
    updates = node.get_json("/api/v1/model/info")["updates"]
    rng = np.random.default_rng(sorted(EXPECTED).index(attack))
    # 2% of every tensor, the same coordinates for everyone: the contributions of one hand-over overlap
    support = [np.sort(rng.choice(t["elements"], max(1, t["elements"] // 50), replace=False)) for t in manifest]
    truth = [rng.normal(0, GRAD_SCALE, idx.size) for idx in support]
    honest = [honest_sections(rng, support, truth) for _ in range(3)]
    for packet, status in attack_packets(attack, step, rng, support, truth, honest):
        answer = post(node, packet)
        assert answer[0] == status, answer[1]
        if status == 400:
            assert "256" in answer[1]["message"]  # the cap, named
    for i, sections in enumerate(honest):
        assert post(node, dgrd.encode(step, f"{attack}-honest-{i}", 3.0, 4, sections))[0] == 200
    wait_until(lambda: _step(node) == step + 1, 60, "the update")
    after_step, after = download_f32(node, manifest)
    assert after_step == step + 1 and node.get_json("/api/v1/model/info")["updates"] == updates + 1
    assert_one_adamw_step(before, after, t=updates + 1)
    losses = node.get_json("/api/v1/server/losses")
    assert len(losses) == updates + 1 and losses[-1] == pytest.approx(3.0)  # every packet said 3.0
    if attack == "huge_samples":
        assert node.get_json("/api/v1/model/info")["train"]["max_samples_per_packet"] == 256

    ledger = {r["node_id"]: r for r in node.get_json("/api/v1/contributors")["contributors"]}
    outliers, rejected = EXPECTED[attack]
    mine = ledger[attack]
    assert (mine["accepted"], mine["outliers"], mine["rejected"]) == (1, outliers, rejected)
    assert mine["samples_claimed"] == (256 if attack.startswith("huge") else 4)
    # max_weight_multiple (4 by default) bounds a claim at 4x the hand-over's median samples
    assert mine["samples_credited"] == {"huge_samples": 16, "huge_values": 16}.get(attack, mine["samples_claimed"])
    for i in range(3):
        record = ledger[f"{attack}-honest-{i}"]
        assert (record["accepted"], record["outliers"], record["rejected"], record["samples_credited"]) == (1, 0, {}, 4)


def test_a_contributor_over_its_rate_gets_429_with_retry_after(node):
    step = _step(node)
    packet = dgrd.encode(step, "eager", 3.0, 1, [(1, np.array([5]), np.array([0.1], np.float32))])
    answers = [post(node, packet) for _ in range(3)]  # burst 2
    assert [a[0] for a in answers[:2]] == [200, 200]
    status, body, headers = answers[2]
    assert status == 429 and float(headers["Retry-After"]) > 0 and "eager" in body["message"]
    record = {r["node_id"]: r for r in node.get_json("/api/v1/contributors")["contributors"]}["eager"]
    assert record["accepted"] == 2 and record["rejected"] == {"rate_limited": 1}


# ---------------------------------------------------------------------------------------------------------
# the opt-in direction check (--min-cosine) on a real node: its reference is the node's own Adam momentum


@pytest.mark.slow
def test_direction_check_drops_a_packet_against_the_momentum_and_nothing_else(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps({**TRAIN, "min_nodes_for_update": 1}))
    proc = InProcessNode("direction", ["--model-config", str(TINY_CONFIG), "--train-config", str(tmp_path / "train.json"),
                                     "--no-data", "--min-cosine", "-0.05"], new_run_id())
    try:
        proc.wait_ready()
        manifest = proc.get_json("/api/v1/model/manifest")["tensors"]
        step, start = download_f32(proc, manifest)
        rng = np.random.default_rng(3)
        idx = [np.sort(rng.choice(t["elements"], max(1, t["elements"] // 50), replace=False)) for t in manifest]
        g1 = [rng.normal(0, GRAD_SCALE, i.size).astype(np.float32) for i in idx]
        g2 = [(0.5 * a + rng.normal(0, GRAD_SCALE, a.size)).astype(np.float32) for a in g1]  # cos with g1 ~ +0.45
        packet = lambda s, who, g: dgrd.encode(s, who, 3.0, 4, list(zip(range(len(idx)), idx, g)))  # noqa: E731
        assert post(proc, packet(step, "first", g1), token=None)[0] == 200
        wait_until(lambda: _step(proc) == step + 1, 60, "the first update")  # no momentum before it: not checked
        assert post(proc, packet(step + 1, "flipper", [-a for a in g1]), token=None)[0] == 200
        latest = lambda: proc.get_json("/api/v1/contributors?limit=1")["contributors"][0]  # noqa: E731
        wait_until(lambda: latest()["node_id"] == "flipper" and latest()["outliers"] == 1, 30, "the flip counted")
        assert post(proc, packet(step + 1, "second", g2), token=None)[0] == 200
        wait_until(lambda: _step(proc) == step + 2, 60, "the second update")
        _, after = download_f32(proc, manifest)
        ledger = {r["node_id"]: r for r in proc.get_json("/api/v1/contributors")["contributors"]}
        flipper = ledger["flipper"]
        assert (flipper["accepted"], flipper["outliers"], flipper["samples_credited"]) == (1, 1, 0)
        assert all((ledger[w]["outliers"], ledger[w]["samples_credited"]) == (0, 4) for w in ("first", "second"))
        # the bytes are those of two AdamW steps on g1 then g2 alone: the flipped packet added nothing
        params = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in start]
        opt = gpt2_adamw(params, [t["shape"] for t in manifest], lr=TRAIN["learning_rate"],
                         betas=(TRAIN["beta1"], TRAIN["beta2"]), eps=TRAIN["eps"], weight_decay=TRAIN["weight_decay"])
        for g in (g1, g2):
            for p, i, v in zip(params, idx, g):
                p.grad = torch.zeros_like(p)
                p.grad[torch.from_numpy(i)] = torch.from_numpy(v)
            opt.step()
        for tid, (p, a) in enumerate(zip(params, after)):
            np.testing.assert_allclose(a, p.detach().numpy(), rtol=1e-5, atol=1e-7, err_msg=f"tensor {tid}")
        assert proc.get_json("/api/v1/server/losses") == [pytest.approx(3.0), pytest.approx(3.0)]
    finally:
        proc.kill()
