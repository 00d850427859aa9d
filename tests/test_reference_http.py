"""A node with its default defences against real gradients over real HTTP: the trusted reference (its own gradient on
the packaged corpus, `--reference-batch 4`), the weight bound, near-copies counted once, and contributor scoring
(403 for a scored-out contributor). Honest packets are real top-1% gradients of the node's model on batches the node
hands out (clients/contribute.py's code path); each attack is made of them."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from dtrain.bridge import dgrd
from dtrain.clients.contribute import ContributeConfig, Contributor
from tests.inproc import InProcessNode
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until
from tests.test_bridge_semantics import download_f32

pytestmark = [pytest.mark.http, pytest.mark.timeout(300)]

TRAIN = {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}


def start(tmp_path, name: str, min_nodes: int) -> InProcessNode:
    (tmp_path / "train.json").write_text(json.dumps({**TRAIN, "min_nodes_for_update": min_nodes}))
    return InProcessNode(name, ["--model-config", str(TINY_CONFIG), "--train-config", str(tmp_path / "train.json"),
                                "--reference-batch", "4", "--rate-burst", "100"], new_run_id())


def post(node, packet: bytes):
    request = urllib.request.Request(node.url + "/api/v1/train/submit", data=packet,
                                     headers={"Content-Type": "application/octet-stream"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def contributor(node, node_id: str, batch_size: int = 8, seq_len: int = 64) -> Contributor:
    """A contributor whose gradients are on enough text that their direction is the data's: on 2 x 32 tokens an
    honest gradient's cosine with the node's 4-sequence reference is negative now and then (-0.05 seen), and a
    sign-flipped one's then positive, which the reference rightly judges by its direction."""
    c = Contributor(ContributeConfig(node_url=node.url, fmt="f32", topk=0.01, batch_size=batch_size, seq_len=seq_len,
                                     node_id=node_id))
    c.fetch_model()
    return c


def real_packet(c: Contributor, step: int, transform=lambda g: g, samples: int = 2, node_id: str | None = None):
    """A top-1% packet of c's gradient on a batch the node hands out, `transform`ed (the attack)."""
    loss, grads = c.compute(c.next_batch())
    c.residual = [np.zeros_like(r) for r in c.residual]  # every packet its own gradient: no error feedback
    packet = c.make_packet(step, loss, [transform(g) for g in grads], samples)
    if node_id is None:
        return packet
    p = dgrd.decode(packet, [r.size for r in c.residual])
    return dgrd.encode(step, node_id, p.train_loss, p.samples, [(s.tensor_id, s.indices, s.values) for s in p.sections])


def ledger(node) -> dict:
    return {r["node_id"]: r for r in node.get_json("/api/v1/contributors?limit=1000")["contributors"]}


@pytest.mark.slow
def test_each_attack_as_real_packets_leaves_the_honest_mean_exact(tmp_path):
    """One hand-over per attack: two honest contributors and the attack. An attack the defaults count 0 leaves the
    bytes of one AdamW step on the two honest packets' exact mean; the others are bounded and counted."""
    node = start(tmp_path, "attacks", min_nodes=3)
    try:
        node.wait_ready()
        manifest = node.get_json("/api/v1/model/manifest")["tensors"]
        elements = [t["elements"] for t in manifest]
        step, start_params = download_f32(node, manifest)
        params = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in start_params]
        opt = torch.optim.AdamW(params, lr=TRAIN["learning_rate"], betas=(TRAIN["beta1"], TRAIN["beta2"]),
                                eps=TRAIN["eps"], weight_decay=TRAIN["weight_decay"])
        rng = np.random.default_rng(0)
        zero_weight = {"huge_samples", "sign_flip", "sybil"}
        # the attacks counted 0 first: while only honest packets moved the model, its bytes are replayed exactly
        for attack in ("sign_flip", "huge_samples", "sybil", "scaled_x1000", "noise", "little_is_enough"):
            honest = [contributor(node, f"{attack}-h{i}") for i in range(2)]
            packets = [real_packet(h, step) for h in honest]
            bad = contributor(node, attack)
            if attack == "sign_flip":
                attacks = [real_packet(bad, step, lambda g: -g)]
            elif attack == "huge_samples":
                attacks = [real_packet(bad, step, lambda g: -g, samples=256)]
            elif attack == "sybil":  # one party, one flipped packet, two ids: the second a near-copy as well
                one = real_packet(bad, step, lambda g: -g, samples=256)
                p = dgrd.decode(one, elements)
                attacks = [dgrd.encode(step, f"sybil-id{i}", p.train_loss, p.samples,
                                       [(s.tensor_id, s.indices, s.values) for s in p.sections]) for i in range(2)]
            elif attack == "scaled_x1000":
                attacks = [real_packet(bad, step, lambda g: 1000 * g)]
            elif attack == "noise":
                attacks = [dgrd.encode(step, attack, 3.0, 2, [(tid, np.sort(rng.choice(e, e // 100 + 1, replace=False)),
                                                                rng.normal(size=e // 100 + 1).astype(np.float32))
                                                               for tid, e in enumerate(elements)])]
            else:  # mean - std of the honest packets on every coordinate they touched (Baruch et al. 2019)
                rows = np.zeros((2, sum(elements)), np.float32)
                ends = np.cumsum([0] + elements)
                for r, body in enumerate(packets):
                    for s in dgrd.decode(body, elements).sections:
                        rows[r, ends[s.tensor_id] + s.indices] += s.values
                touched = np.flatnonzero(rows.any(axis=0))
                shifted = rows[:, touched].mean(axis=0) - rows[:, touched].std(axis=0)
                sections = []
                for tid in range(len(elements)):
                    mine = (touched >= ends[tid]) & (touched < ends[tid + 1])
                    if mine.any():
                        sections.append((tid, touched[mine] - ends[tid], shifted[mine]))
                attacks = [dgrd.encode(step, attack, 3.0, 2, sections)]
            hand_over = packets + attacks
            if attack == "sybil":
                hand_over = [packets[0], *attacks]  # three packets: the update waits for no more
                packets = packets[:1]
            for body in hand_over:
                status, answer = post(node, body)
                assert status == 200, answer
            wait_until(lambda: node.get_json("/api/v1/model/info")["step"] == step + 1, 60, f"the {attack} update")
            after_step, after = download_f32(node, manifest)
            assert after_step == step + 1 and all(np.isfinite(a).all() for a in after)
            records = ledger(node)
            for h in [r for r in records if r.startswith(f"{attack}-h")][:len(packets)]:
                assert records[h]["samples_credited"] == 2 and records[h]["outliers"] == 0, records[h]
                assert records[h]["agreed"] == 1 and records[h]["disagreed"] == 0
            attackers = ["sybil-id0", "sybil-id1"] if attack == "sybil" else [attack]
            for a in attackers:
                if attack in zero_weight:
                    assert records[a]["samples_credited"] == 0 and records[a]["outliers"] == 1, records[a]
                else:
                    assert records[a]["accepted"] == 1
            if attack == "scaled_x1000":
                assert records[attack]["outliers"] == 1 and records[attack]["samples_credited"] == 2  # norm-clipped
            if attack == "noise":
                assert records[attack]["outliers"] == 1  # counted 0 or norm-clipped, whichever its cosine says
            if attack in zero_weight:  # the update is one AdamW step on the honest packets' exact mean alone
                grads = [np.zeros(e, np.float32) for e in elements]
                for body in packets:
                    for s in dgrd.decode(body, elements).sections:
                        np.add.at(grads[s.tensor_id], s.indices, s.values * np.float32(2))
                for p, g in zip(params, grads):
                    p.grad = torch.from_numpy(g / np.float32(2 * len(packets))).view_as(p)
                opt.step()
                for tid, (p, a) in enumerate(zip(params, after)):
                    np.testing.assert_allclose(a, p.detach().numpy(), rtol=1e-5, atol=1e-7,
                                               err_msg=f"{attack}: tensor {tid}")
            step = after_step
    finally:
        node.kill()


@pytest.mark.slow
def test_a_persistently_disagreeing_contributor_is_refused_with_403(tmp_path):
    node = start(tmp_path, "scored", min_nodes=1)
    try:
        node.wait_ready()
        step = node.get_json("/api/v1/model/info")["step"]
        flipper = contributor(node, "flipper")
        for i in range(8):  # counted 0 each time: the model does not move, the step stays
            status, answer = post(node, real_packet(flipper, step, lambda g: -g))
            assert status == 200, answer
            wait_until(lambda: ledger(node).get("flipper", {}).get("disagreed") == i + 1, 30, f"flipped packet {i}")
        record = ledger(node)["flipper"]
        assert record["scored_out"] and record["agreed"] == 0 and record["samples_credited"] == 0
        assert node.get_json("/api/v1/model/info")["step"] == step
        status, answer = post(node, real_packet(flipper, step))  # even an honest packet now
        assert status == 403 and not answer["ok"] and "flipper" in answer["message"]
        assert "0 of its last 8" in answer["message"] and answer["server_step"] == step
        assert ledger(node)["flipper"]["rejected"] == {"scored_out": 1}
        honest = contributor(node, "honest")
        assert post(node, real_packet(honest, step))[0] == 200  # others go on
        wait_until(lambda: node.get_json("/api/v1/model/info")["step"] == step + 1, 60, "the honest update")
        assert ledger(node)["honest"]["samples_credited"] == 2 and not ledger(node)["honest"]["scored_out"]
        summary = node.get_json("/api/v1/contributors")["summary"]
        assert summary["scored_out"] == 1
        with urllib.request.urlopen(node.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert "dtrain_scored_out_contributors 1.0" in metrics
        assert 'dtrain_packets_rejected_total{reason="scored_out",status="403"} 1.0' in metrics
        assert "dtrain_reference_gradients_total" in metrics
    finally:
        node.kill()
