"""Real multi-peer swarms on 127.0.0.1: lockstep training, late joiners, the CLI's lifecycle, checkpoints."""
from __future__ import annotations

import itertools
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from dtrain.bridge import dgrd
from dtrain.node.swarm.records import RECORD_TTL_S as NODES_TTL_S
from tests.texts import shakespeare
from tests.nodeproc import (PER_STEP, REPO, TINY_CONFIG, NodeProcess, new_run_id, pid_alive, print_logs, start_swarm,
                            wait_until)
from tests.test_bridge_semantics import submit

pytestmark = pytest.mark.swarm

BATCH = 4  # --local-batch-size of every test node


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(shakespeare(30_000))
    return path


def _train_args(text_file, peers: int, extra=()):
    # one update needs every peer's batch: peers stay in lockstep and all-reduce together
    return [*PER_STEP, "--model-config", str(TINY_CONFIG), "--train-data", str(text_file),
            "--local-batch-size", str(BATCH), "--local-seq-len", "32", "--local-samples-per-update", str(BATCH),
            "--target-batch-size", str(BATCH * peers), *extra]


def _kill_all(nodes):
    for node in nodes:
        node.kill()


@pytest.mark.timeout(360)
def test_peers_byte_identical_after_each_epoch_and_a_late_joiner_catches_up_before_serving(text_file):
    # two peers training on their own data (three nodes are test_lossless_swarm's, with bridge traffic on each); then
    # a node joins late, with nothing to train on of its own
    peers = 2
    run_id = new_run_id()
    nodes = start_swarm(peers, _train_args(text_file, peers), run_id)
    swarm = list(nodes)
    try:
        # the late node joins once the two train in lockstep: its join (a download, about 20 s) runs while they
        # train the epochs checked below, instead of after them
        _check_lockstep(swarm, peers, epochs=1)
        late = _start_late_joiner(nodes, run_id)
        _check_lockstep(swarm, peers, epochs=3)
        _check_late_joiner(swarm, late)
        for node in nodes:
            node.terminate()
    except BaseException:
        print_logs(nodes)
        raise
    finally:
        _kill_all(nodes)


def _check_lockstep(nodes, peers: int, epochs: int) -> None:
    joined = max(min(n.digests()) for n in nodes)  # every node serves from here on

    def common_steps():
        steps = set.intersection(*(set(n.digests()) for n in nodes))
        return sorted(s for s in steps if s > joined)

    wait_until(lambda: len(common_steps()) >= epochs, 200, f"{epochs} epochs of {peers} peers", interval_s=1.0)
    digests = {n.name: n.digests() for n in nodes}
    # every step two nodes both served has the same bytes on both (a node that fell behind may skip steps as it
    # catches up, but never serves a step of its own)
    for a, b in itertools.combinations(digests, 2):
        for step in sorted(set(digests[a]) & set(digests[b])):
            if step > joined:
                assert digests[a][step] == digests[b][step], f"step {step} differs between {a} and {b}"
    repaired = sum(n.output().count("parameters differ from those of peer") for n in nodes)
    print(f"{len(common_steps())} epochs byte-identical across {peers} peers; "
          f"{repaired} peer-updates repaired after a failed averaging round")


def _start_late_joiner(nodes, run_id: str) -> NodeProcess:
    """A node joining the training swarm `nodes` once it is past two epochs, with nothing to train on of its own;
    appended to `nodes`."""
    wait_until(lambda: min(max(n.digests(), default=0) for n in nodes) >= 3, 120, "two epochs")
    late = NodeProcess("late", [*PER_STEP, "--model-config", str(TINY_CONFIG)], run_id,
                       initial_peers=nodes[0].wait_ready())
    nodes.append(late)
    return late


def _check_late_joiner(swarm, late: NodeProcess) -> None:
    """A node joining a training swarm (`_start_late_joiner`) serves, from its first step, the swarm's bytes."""
    late.wait_ready()
    first_step, first_digest = min(late.digests().items())
    assert first_step >= 3, late.output()[-2000:]
    # the parameters it serves first are the swarm's at that step, to the byte. A peer that was catching up itself
    # may have gone past that step without serving it (from step 4 to a download of step 6, say); every peer that
    # served it served these bytes
    wait_until(lambda: any(first_step in n.digests() for n in swarm), 60, "a peer to publish that step")
    served = [n.digests()[first_step] for n in swarm if first_step in n.digests()]
    assert served and all(digest == first_digest for digest in served), (first_digest, served)
    assert late.status()["step"] >= first_step


@pytest.mark.timeout(180)
def test_joiner_of_an_idle_swarm_checks_its_download():
    """Peers keep the digest of the step they serve in the DHT: a node joining a swarm that has been idle for
    longer than a record's lifetime still checks what it downloaded, at once."""
    run_id = new_run_id()
    a = NodeProcess("A", [*PER_STEP, "--model-config", str(TINY_CONFIG), "--target-batch-size", "4"], run_id)
    nodes = [a]
    try:
        a.wait_ready()
        manifest = a.get_json("/api/v1/model/manifest")["tensors"]
        gradient = np.full(manifest[0]["elements"], 0.01, np.float32)
        status, body = submit(a, dgrd.encode(1, "browser-0", 3.0, 4, [(0, None, gradient)], flags=0))
        assert status == 200, body
        wait_until(lambda: 2 in a.digests(), 60, "A's update")
        time.sleep(NODES_TTL_S + 2)  # every record published with the update has expired unless refreshed
        b = NodeProcess("B", [*PER_STEP, "--model-config", str(TINY_CONFIG)], run_id, initial_peers=a.wait_ready())
        nodes.append(b)
        b.wait_ready()
        assert "No peer published its parameters" not in b.output(), b.output()[-3000:]
        assert min(b.digests().items()) == (2, a.digests()[2])
    finally:
        _kill_all(nodes)


@pytest.mark.timeout(120)
def test_cli_join_report_and_sigterm(tmp_path):
    run_id = new_run_id()
    a = NodeProcess("A", [*PER_STEP, "--model-config", str(TINY_CONFIG)], run_id)
    nodes = [a]
    try:
        maddrs = a.wait_ready()
        # peer ids are sha2-256 hashes of RSA keys: a node signs its records with its libp2p identity
        assert maddrs and all("/p2p/Qm" in m for m in maddrs)
        assert f"dtrain-node --initial-peers {maddrs[0]}" in a.output()
        b = NodeProcess("B", [*PER_STEP, "--model-config", str(TINY_CONFIG),
                              "--identity-path", str(tmp_path / "b.key")], run_id, initial_peers=maddrs)
        nodes.append(b)
        b.wait_ready()
        b_id = b.status()["peer_id"]
        assert a.status()["peer_id"] != b_id
        # each sees the other in the swarm's progress records
        wait_until(lambda: a.status()["peers"] == 2 and b.status()["peers"] == 2, 60, "peers to see each other")
        children = a.children() + b.children()
        assert children, "expected p2pd children"
        for node in nodes:
            assert node.terminate(timeout_s=15) < 15
            assert node.proc.returncode == 0, node.output()[-2000:]
        for pid in children:
            wait_until(lambda: not pid_alive(pid), 5, f"child {pid} to exit")
        # a stable identity: the same key file gives the same peer id on restart
        b2 = NodeProcess("B2", [*PER_STEP, "--model-config", str(TINY_CONFIG),
                                "--identity-path", str(tmp_path / "b.key")], new_run_id())
        nodes.append(b2)
        b2.wait_ready()
        assert b2.status()["peer_id"] == b_id
    finally:
        _kill_all(nodes)


@pytest.mark.timeout(180)
def test_checkpoint_round_trip(text_file, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    args = _train_args(text_file, 1, ["--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "2",
                                      "--torch-threads", "1"])
    node = NodeProcess("A", args, new_run_id())
    try:
        node.wait_ready()
        assert node.status()["torch_threads"] == {"intra_op": 1, "inter_op": 1}  # the node's one thread budget
        wait_until(lambda: node.status()["step"] >= 4, 90, "four updates")
        node.terminate()
        # the loss history of the last step, as the stopping node logged it
        logged_losses = [float(x) for x in re.findall(r"update \d+: \d+ samples, loss ([0-9.]+)", node.output())]
        last_step, last_digest = max(node.digests().items())
        assert (ckpt_dir / "state.safetensors").exists() and not (ckpt_dir / "state.safetensors.tmp").exists()
        # the checkpoint leaves as a Hugging Face directory holding exactly the last step's parameters
        out = subprocess.run([sys.executable, "-m", "dtrain.clients.export", "--checkpoint", str(ckpt_dir), "--out",
                              str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and last_digest in out.stdout, out.stderr
        assert f"step {last_step}" in (tmp_path / "hf" / "README.md").read_text()
        restarted = NodeProcess("A2", [*PER_STEP, "--model-config", str(TINY_CONFIG), "--checkpoint-dir", str(ckpt_dir)],
                                new_run_id())
        try:
            restarted.wait_ready()
            status = restarted.status()
            assert status["step"] == last_step
            assert status["params_sha256"] == last_digest
            losses = restarted.get_json("/api/v1/server/losses")
            assert len(losses) == last_step - 1 == len(logged_losses)
            assert [round(x, 4) for x in losses] == logged_losses
        finally:
            restarted.kill()
    finally:
        node.kill()
