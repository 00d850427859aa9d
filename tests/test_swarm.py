"""Real multi-peer swarms on 127.0.0.1: lockstep training, late joiners, the CLI's lifecycle, checkpoints."""
from __future__ import annotations

import re

import pytest

from tests.nodeproc import REPO, TINY_CONFIG, NodeProcess, new_run_id, pid_alive, wait_until

TRAIN_TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
BATCH = 4  # --local-batch-size of every test node


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(TRAIN_TEXT.read_text()[:30_000])
    return path


def _train_args(text_file, peers: int, extra=()):
    # one update needs every peer's batch: peers stay in lockstep and all-reduce together
    return ["--model-config", str(TINY_CONFIG), "--train-data", str(text_file),
            "--local-batch-size", str(BATCH), "--local-seq-len", "32", "--local-samples-per-update", str(BATCH),
            "--target-batch-size", str(BATCH * peers), *extra]


def _start_swarm(n: int, args, run_id: str) -> list[NodeProcess]:
    nodes = [NodeProcess("A", args, run_id)]
    maddrs = nodes[0].wait_ready()
    assert maddrs, nodes[0].output()
    for name in "BCDE"[: n - 1]:
        nodes.append(NodeProcess(name, args, run_id, initial_peers=maddrs))
    for node in nodes[1:]:
        node.wait_ready()
    return nodes


def _kill_all(nodes):
    for node in nodes:
        node.kill()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("peers", [2, 3])
def test_peers_byte_identical_after_each_epoch(text_file, peers):
    nodes = _start_swarm(peers, _train_args(text_file, peers), new_run_id())
    run = 4  # consecutive updates that must be joint rounds of every peer
    try:
        joined = max(min(n.digests()) for n in nodes)

        def same(step: int) -> bool:
            # hivemind's all-reduce hands each peer `local + (average - local)`, which can differ from the
            # average in the last bit where parameters cross zero: equal bytes, or norms within float32 rounding
            digests, norms = [n.digests() for n in nodes], [n.norms() for n in nodes]
            if not all(step in d for d in digests):
                return False
            values = [n[step] for n in norms]
            return len({d[step] for d in digests}) == 1 or (max(values) - min(values)) / max(values) < 1e-6

        def lockstep_window():
            published = min(max(n.digests()) for n in nodes)
            for first in range(joined + 1, published - run + 2):
                if all(same(s) for s in range(first, first + run)):
                    return first
            return None

        # a round whose averaging times out (a loaded machine) leaves peers apart until the next round
        # re-averages their state; the swarm must reach `run` joint updates in a row
        first = wait_until(lockstep_window, 200, f"{run} joint updates of {peers} peers", interval_s=1.0)
        digests = [n.digests() for n in nodes]
        identical = sum(len({d[s] for d in digests}) == 1 for s in range(first, first + run))
        apart = [s for s in range(joined + 1, first) if not same(s)]
        print(f"steps {first}..{first + run - 1}: {identical} of {run} byte-identical across {peers} peers; "
              f"rounds apart before: {apart}")
        for node in nodes:
            node.terminate()
    finally:
        _kill_all(nodes)


@pytest.mark.timeout(240)
def test_late_joiner_catches_up_before_serving(text_file):
    run_id = new_run_id()
    args = _train_args(text_file, 2)
    nodes = _start_swarm(2, args, run_id)
    try:
        wait_until(lambda: min(max(n.digests(), default=0) for n in nodes) >= 3, 120, "two epochs")
        late = NodeProcess("late", ["--model-config", str(TINY_CONFIG)], run_id, initial_peers=nodes[0].wait_ready())
        nodes.append(late)
        late.wait_ready()
        first_step, first_digest = min(late.digests().items())
        assert first_step >= 3, late.output()[-2000:]
        # the parameters it serves first are those of the peer it downloaded from, at that step, to the byte
        # (two peers can be apart for a round when averaging times out; the joiner matches its source)
        source = re.search(r"Finished downloading state in \S+ from (\S+)", late.output()).group(1)
        peer = next(n for n in nodes[:2] if n.status()["peer_id"] == source)
        wait_until(lambda: first_step in peer.digests(), 60, "the source peer to publish the joiner's step")
        # hivemind's catch-up may label the downloaded state with the swarm's next epoch
        # (Optimizer.load_state_from_peers: "Catching up with collaboration step"), so the bytes are the source
        # peer's at that step or the one before; anything else would be a state the swarm never had
        assert first_digest in (peer.digests()[first_step], peer.digests().get(first_step - 1))
        status = late.status()
        assert status["step"] >= first_step
    finally:
        _kill_all(nodes)


@pytest.mark.timeout(120)
def test_cli_join_report_and_sigterm(tmp_path):
    run_id = new_run_id()
    a = NodeProcess("A", ["--model-config", str(TINY_CONFIG)], run_id)
    nodes = [a]
    try:
        maddrs = a.wait_ready()
        assert maddrs and all("/p2p/12D3" in m for m in maddrs)
        assert f"dtrain-node --initial-peers {maddrs[0]}" in a.output()
        b = NodeProcess("B", ["--model-config", str(TINY_CONFIG),
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
        b2 = NodeProcess("B2", ["--model-config", str(TINY_CONFIG),
                                "--identity-path", str(tmp_path / "b.key")], new_run_id())
        nodes.append(b2)
        b2.wait_ready()
        assert b2.status()["peer_id"] == b_id
    finally:
        _kill_all(nodes)


@pytest.mark.timeout(180)
def test_checkpoint_round_trip(text_file, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    args = _train_args(text_file, 1, ["--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "2"])
    node = NodeProcess("A", args, new_run_id())
    try:
        node.wait_ready()
        wait_until(lambda: node.status()["step"] >= 4, 90, "four updates")
        node.terminate()
        # the loss history of the last step, as the stopping node logged it
        logged_losses = [float(x) for x in re.findall(r"update \d+: \d+ samples, loss ([0-9.]+)", node.output())]
        last_step, last_digest = max(node.digests().items())
        assert (ckpt_dir / "state.pt").exists() and not (ckpt_dir / "state.pt.tmp").exists()
        restarted = NodeProcess("A2", ["--model-config", str(TINY_CONFIG), "--checkpoint-dir", str(ckpt_dir)],
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
