"""What accepted and rejected packets do to a real node: min_nodes_for_update, the AdamW update, late packets.

One node (no dataset, min_nodes_for_update 2, target batch 1) serves the module; nothing but these tests
moves it. Tests read the step they start from, and each leaves no contributor pending.
"""
from __future__ import annotations

import json
import struct
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from dtrain.bridge import dgrd
from tests.adamw import gpt2_adamw
from tests.inproc import InProcessNode
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until

pytestmark = [pytest.mark.http, pytest.mark.timeout(240)]

TRAIN_CONFIG = {"learning_rate": 0.002, "beta1": 0.8, "beta2": 0.95, "eps": 1e-06, "weight_decay": 0.1,
                "min_nodes_for_update": 2}
SETTLE_S = 1.0  # how long a test lets a node that must not update show that it does not


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    config = tmp_path_factory.mktemp("semantics") / "train.json"
    config.write_text(json.dumps(TRAIN_CONFIG))
    proc = InProcessNode("semantics", ["--model-config", str(TINY_CONFIG), "--target-batch-size", "1",
                                     "--train-config", str(config)], new_run_id())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def manifest(node):
    return node.get_json("/api/v1/model/manifest")["tensors"]


def submit(node, packet: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(node.url + "/api/v1/train/submit", data=packet, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def info(node) -> dict:
    return node.get_json("/api/v1/model/info")


def pending(node) -> int:
    return node.status()["pending_contributors"]


def download_f32(node, manifest) -> tuple[int, list[np.ndarray]]:
    """Every tensor as float32 from one step (retried if an update lands in the middle)."""
    for _ in range(5):
        arrays, steps = [], set()
        for t in manifest:
            with urllib.request.urlopen(f"{node.url}/api/v1/model/tensor/{t['id']}?format=f32", timeout=30) as r:
                steps.add(int(r.headers["X-Model-Step"]))
                arrays.append(np.frombuffer(r.read(), "<f4").copy())
        if len(steps) == 1:
            return steps.pop(), arrays
    raise AssertionError("the model kept moving during downloads")


def wait_step(node, step: int) -> None:
    wait_until(lambda: info(node)["step"] >= step, 30, f"step {step}", interval_s=0.05)


def settle_and_check(node, step: int, updates: int) -> None:
    time.sleep(SETTLE_S)
    now = info(node)
    assert (now["step"], now["updates"]) == (step, updates)


def flush(node, step: int) -> None:
    """Make the node update once (two contributors) so a test starts with no one pending."""
    for nid in ("flush-a", "flush-b"):
        assert submit(node, dgrd.encode(step, nid, 1.0, 1, [(2, np.array([0]), np.ones(1, np.float32))]))[0] == 200
    wait_step(node, step + 1)


def weighted_gradient(manifest, contributions) -> list[np.ndarray]:
    """sum(samples_i * g_i) / sum(samples_i), accumulated as the node does (float32)."""
    sums = [np.zeros(t["elements"], np.float32) for t in manifest]
    total = 0
    for samples, sections in contributions:
        packet = dgrd.Packet(1, 0, 0, "x", 0.0, samples, tuple(
            dgrd.Section(tid, None if idx is None else np.asarray(idx, np.int64), np.asarray(v, np.float32))
            for tid, idx, v in sections))
        dgrd.accumulate(packet, sums, float(samples))
        total += samples
    return [s / np.float32(total) for s in sums]


def adamw_step(manifest, params: list[np.ndarray], grads: list[np.ndarray], steps_before: int = 0) -> list[np.ndarray]:
    """One torch AdamW step from fresh state, GPT-2's weight-decay grouping; `steps_before` zero-gradient, lr-0 steps
    first only count up Adam's step (what hivemind's initialize_optimizer_state_ leaves behind), for the diagnosis
    below."""
    tensors = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
    opt = gpt2_adamw(tensors, [t["shape"] for t in manifest], lr=TRAIN_CONFIG["learning_rate"],
                     betas=(TRAIN_CONFIG["beta1"], TRAIN_CONFIG["beta2"]), eps=TRAIN_CONFIG["eps"],
                     weight_decay=TRAIN_CONFIG["weight_decay"])
    for _ in range(steps_before):
        for group in opt.param_groups:
            group["lr"] = 0.0
        for t in tensors:
            t.grad = torch.zeros_like(t)
        opt.step()
        for group in opt.param_groups:
            group["lr"] = TRAIN_CONFIG["learning_rate"]
    for t, g in zip(tensors, grads):
        t.grad = torch.from_numpy(g.copy())
    opt.step()
    return [t.detach().numpy() for t in tensors]


def test_second_contributor_triggers_exactly_one_adamw_update(node, manifest):
    start = info(node)
    if start["updates"] != 0:
        pytest.skip("needs the node's first update: Adam's moments must be fresh to predict it")
    step = start["step"]
    before_step, before = download_f32(node, manifest)
    assert before_step == step
    rng = np.random.default_rng(0)
    e = [t["elements"] for t in manifest]

    # alice: Mode 1 on the embedding and a layer norm, Mode 3 (dense) on a bias; samples 3
    alice = [(0, np.array([5, 77, 1000, 5]), rng.normal(size=4).astype(np.float32)),
             (2, np.arange(0, e[2], 3), rng.normal(size=len(range(0, e[2], 3))).astype(np.float32)),
             (3, None, rng.normal(size=e[3]).astype(np.float16).astype(np.float32))]
    code, body = submit(node, dgrd.encode(step, "alice", 2.5, 3, alice))
    assert (code, body) == (200, {"ok": True, "message": "ok", "server_step": step})
    settle_and_check(node, step, 0)
    assert pending(node) == 1
    assert node.get_json("/api/v1/server/losses") == []

    # alice again: still one distinct contributor, her gradient adds up
    alice2 = [(2, np.array([1]), np.array([0.75], np.float32))]
    assert submit(node, dgrd.encode(step, "alice", 2.0, 1, alice2))[0] == 200
    settle_and_check(node, step, 0)
    assert pending(node) == 1

    # mallory: a valid first section, then an index past the end: nothing of it may count
    bad = dgrd.encode(step, "mallory", 9.0, 50, [(1, np.arange(10), np.full(10, 100.0, np.float32)),
                                                 (4, np.array([0]), np.ones(1, np.float32))])
    bad = bad[:-8] + struct.pack("<If", e[4], 1.0)
    code, body = submit(node, bad)
    assert code == 400 and body["server_step"] == step and "index" in body["message"]
    # zed: a packet for a step the node has not reached
    code, body = submit(node, dgrd.encode(step + 1, "zed", 9.0, 50, [(1, np.array([0]), np.ones(1))]))
    assert (code, body["server_step"]) == (409, step)
    settle_and_check(node, step, 0)
    assert pending(node) == 1

    # bob: a second distinct contributor, Mode 2; samples 2
    bob_values = rng.normal(size=6).astype(np.float16).astype(np.float32)
    bob = [(0, np.array([5, 6, 300, 301, 5000, 123456]), bob_values), (3, np.array([0]), np.array([-2.0], np.float32))]
    assert submit(node, dgrd.encode(step, "bob", 3.0, 2, bob, flags=dgrd.FLAGS_MODE2))[0] == 200
    wait_step(node, step + 1)
    settle_and_check(node, step + 1, 1)
    assert pending(node) == 0

    losses = node.get_json("/api/v1/server/losses")
    assert len(losses) == 1
    expected_loss = (3 * 2.5 + 1 * 2.0 + 2 * 3.0) / 6  # every loss is exact in float32
    assert abs(losses[0] - expected_loss) < 1e-6

    after_step, after = download_f32(node, manifest)
    assert after_step == step + 1
    grads = weighted_gradient(manifest, [(3, alice), (1, alice2), (2, bob)])
    expected = adamw_step(manifest, before, grads)
    errors = [float(np.abs(got - want).max()) for got, want in zip(after, expected)]
    if max(errors) > 1e-6:
        warm = adamw_step(manifest, before, grads, steps_before=1)
        warm_error = max(float(np.abs(got - want).max()) for got, want in zip(after, warm))
        worst = int(np.argmax(errors))
        pytest.fail(
            f"the update is not one AdamW step: tensor {worst} ({manifest[worst]['name']}) is off by "
            f"{errors[worst]:.3g}; every tensor matches AdamW whose step count was already 1 within "
            f"{warm_error:.3g} (hivemind's initialize_optimizer_state_ runs a zero-gradient step at start-up, "
            f"which also applied weight decay to the step-1 parameters)" if warm_error <= 1e-6 else
            f"the update is not one AdamW step: tensor {worst} ({manifest[worst]['name']}) is off by "
            f"{errors[worst]:.3g}")


def test_rejected_packets_change_nothing_and_are_no_contributor(node, manifest):
    step, updates = info(node)["step"], info(node)["updates"]
    assert pending(node) == 0
    _, before = download_f32(node, manifest)
    e = [t["elements"] for t in manifest]
    good = dgrd.encode(step, "mallory", 1.0, 4, [(0, np.arange(100), np.ones(100, np.float32)),
                                                 (1, np.array([3]), np.ones(1, np.float32))])
    first = 16 + len("mallory") + 12
    rejected = [
        good[:-8] + struct.pack("<If", e[1], 1.0),  # index past the end, in the last section
        good[:-4] + struct.pack("<f", float("nan")),  # NaN in the last section
        good + b"\x00",  # trailing byte
        good[:first - 8] + struct.pack("<I", 0) + good[first - 4:],  # samples == 0
        dgrd.encode(step, "mallory", 1.0, 4, [(0, np.array([0]), np.ones(1)), (0, np.array([1]), np.ones(1))]),
    ]
    for nid in ("m1", "m2"):
        for packet in rejected:
            packet = packet.replace(b"\x07\x00\x00\x00mallory", struct.pack("<I", 2) + nid.encode())
            code, body = submit(node, packet)
            assert code == 400 and body["server_step"] == step, body
    settle_and_check(node, step, updates)
    assert pending(node) == 0
    after_step, after = download_f32(node, manifest)
    assert after_step == step
    for a, b in zip(before, after):
        assert a.tobytes() == b.tobytes()

    # one valid contributor after the rejected ones is still just one: no update
    assert submit(node, dgrd.encode(step, "carol", 1.0, 1, [(2, np.array([0]), np.ones(1))]))[0] == 200
    settle_and_check(node, step, updates)
    assert pending(node) == 1
    assert submit(node, dgrd.encode(step, "dave", 1.0, 1, [(2, np.array([1]), np.ones(1))]))[0] == 200
    wait_step(node, step + 1)
    settle_and_check(node, step + 1, updates + 1)


def test_late_packets_are_accepted(node):
    if info(node)["step"] < 2:
        flush(node, info(node)["step"])
    step, updates = info(node)["step"], info(node)["updates"]
    losses = node.get_json("/api/v1/server/losses")
    for nid, late in (("late-a", step - 1), ("late-b", max(1, step - 5))):
        code, body = submit(node, dgrd.encode(late, nid, 4.0, 1, [(2, np.array([0]), np.ones(1))]))
        assert (code, body) == (200, {"ok": True, "message": "ok", "server_step": step})
    wait_step(node, step + 1)
    settle_and_check(node, step + 1, updates + 1)
    assert node.get_json("/api/v1/server/losses") == losses + [4.0]
