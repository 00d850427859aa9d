"""The reference contributor (`dtrain-contribute`) against real nodes, in each DGRD mode.

Two nodes (min_nodes_for_update 1, target batch 1) serve the module: `node` has no dataset, so only the
contributor moves it and counts are exact; `data_node` runs with --train-data, hands out batches, and
also trains on its own, so there the bridge's counters (samples_total, contributors) are what is exact.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from dtrain.bridge import dgrd
from dtrain.clients.contribute import ContributeConfig, Contributor, main
from tests.texts import shakespeare
from tests.inproc import InProcessNode
from tests.nodeproc import REPO, TINY_CONFIG, new_run_id, wait_until

pytestmark = [pytest.mark.http, pytest.mark.timeout(300)]

MODES = ("sparse", "compressed", "dense")
STEPS = 3
BATCH = 2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("contribute")
    (d / "train.json").write_text(json.dumps({"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                                              "weight_decay": 0.01, "min_nodes_for_update": 1}))
    (d / "train.txt").write_text(shakespeare(20_000))
    return d


def _start(name, args):
    proc = InProcessNode(name, args, new_run_id())
    try:
        proc.wait_ready()
    except BaseException:
        proc.kill()
        raise
    return proc


def _args(files):
    return ["--model-config", str(TINY_CONFIG), "--target-batch-size", "1", "--train-config", str(files / "train.json")]


@pytest.fixture(scope="module")
def node(files):
    proc = _start("plain", _args(files))
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def data_node(files):
    # it trains on its own all the time: its tests come last in this file, so it starts last
    proc = _start("data", _args(files) + ["--train-data", str(files / "train.txt"),
                                          "--local-batch-size", "1", "--local-seq-len", "16"])
    try:
        yield proc
    finally:
        proc.kill()


def _info(node) -> dict:
    return node.get_json("/api/v1/model/info")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["f16", "f32"])
def test_contributor_moves_a_node_one_update_per_packet(node, files, mode, fmt):
    before = _info(node)
    losses_before = node.get_json("/api/v1/server/losses")
    config = ContributeConfig(node_url=node.url, data_path=str(files / "train.txt"), fmt=fmt, mode=mode, topk=0.05,
                              batch_size=BATCH, seq_len=16, wait_update_s=20.0)
    summary = Contributor(config).run(STEPS)
    assert (summary["accepted"], summary["conflicts"]) == (STEPS, 0)
    wait_until(lambda: _info(node)["step"] >= before["step"] + STEPS, 30, "the node to apply every packet")
    time.sleep(0.5)
    after = _info(node)
    assert after["step"] == before["step"] + STEPS
    assert after["updates"] == before["updates"] + STEPS
    losses = node.get_json("/api/v1/server/losses")
    assert losses[:len(losses_before)] == losses_before
    assert np.allclose(losses[len(losses_before):], summary["losses"], rtol=1e-6)
    assert all(5 < x < 12 for x in summary["losses"])  # a fresh GPT-2 vocabulary model: about ln(50257)


@pytest.mark.parametrize("mode, flags", [("sparse", 0), ("compressed", 1), ("dense", 0)])
def test_packet_and_error_feedback(mode, flags):
    """What is not sent waits in the residual: sent + residual == gradient + previous residual."""
    elements = [1000, 37, 5]
    rng = np.random.default_rng(1)
    c = Contributor(ContributeConfig(node_url="http://127.0.0.1:9", mode=mode, topk=0.1, node_id="fb"))
    c.residual = [np.zeros(n, np.float32) for n in elements]
    for round_ in range(3):
        grads = [rng.normal(size=n).astype(np.float32) for n in elements]
        wanted = [g + r for g, r in zip(grads, c.residual)]
        packet = dgrd.decode(c.make_packet(7, 2.5, grads, samples=4), elements)
        assert (packet.step, packet.node_id, packet.samples, packet.flags) == (7, "fb", 4, flags)
        sent = [np.zeros(n, np.float32) for n in elements]
        dgrd.accumulate(packet, sent)
        if mode == "dense":
            assert all(s.indices is None for s in packet.sections)
            for s, g in zip(sent, grads):
                assert np.array_equal(s, g.astype(np.float16).astype(np.float32))
        else:
            if mode == "sparse":  # Mode 2 adds zero-valued entries to bridge long gaps
                assert [s.indices.size for s in packet.sections] == [100, 4, 1]
            for s, r, w in zip(sent, c.pending_residual, wanted):
                np.testing.assert_allclose(s + r, w, atol=1e-6)
        c.residual = c.pending_residual  # what submit does on 200


@pytest.mark.slow
def test_cli(node, files):
    before = _info(node)["step"]
    out = subprocess.run([sys.executable, "-m", "dtrain.clients.contribute", "--node", node.url, "--data",
                          str(files / "train.txt"), "--mode", "compressed", "--steps", "2", "--batch-size", "1",
                          "--seq-len", "8", "--wait-update", "20"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "round 2/2" in out.stderr and "2 accepted" in out.stderr
    wait_until(lambda: _info(node)["step"] >= before + 2, 30, "two updates")


def test_cli_rejects_bad_flags(capsys):
    for argv, word in ((["--topk", "2"], "--topk"), (["--mode", "zip"], "--mode"), (["--format", "f8"], "--format")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--node", "http://127.0.0.1:9", *argv])
        assert exit_info.value.code == 2
        assert word in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_contributor_with_batches_from_the_node(data_node, mode):
    node = data_node
    status = node.status()
    config = ContributeConfig(node_url=node.url, mode=mode, topk=0.01, batch_size=BATCH, seq_len=16)
    summary = Contributor(config).run(STEPS)
    # the node trains on its own as well, so packets may arrive late or too late (409, then refetch)
    assert summary["accepted"] + summary["conflicts"] == STEPS
    assert summary["accepted"] >= 1
    after = node.status()
    assert after["samples_total"] == status["samples_total"] + BATCH * summary["accepted"]
    assert after["contributors"] == status["contributors"] + 1
    # an accepted packet is applied after its answer: on a fresh node the first update may still be under way
    wait_until(lambda: _info(node)["updates"] > 0, 30, "the node's first update")
    info = _info(node)  # read first: a loss is recorded just before its step is published
    assert len(node.get_json("/api/v1/server/losses")) >= info["updates"] > 0
