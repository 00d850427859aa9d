"""--wait-for-peers on real nodes on 127.0.0.1: a founder that waits for a second node trains on nothing until it
has joined, and both then start from the founder's first state (what a multi-peer run needs to compare modes)."""
from __future__ import annotations

import time

import pytest

from tests.nodeproc import PER_STEP, TINY_CONFIG, NodeProcess, new_run_id, shown_on_failure, wait_until
from tests.texts import shakespeare

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

ALONE_S = 8.0  # a founder alone with local data makes several updates in this time (0.1-0.5 s each on a tiny model)


def test_a_founder_waits_for_its_peer_then_both_train_from_the_first_state(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text(shakespeare(30_000))
    args = [*PER_STEP, "--model-config", str(TINY_CONFIG), "--train-data", str(text), "--local-batch-size", "2",
            "--local-seq-len", "32", "--wait-for-peers", "2"]
    run_id, nodes = new_run_id(), []
    with shown_on_failure(nodes):
        nodes.append(NodeProcess("A", args, run_id))
        maddrs = nodes[0].wait_ready()
        time.sleep(ALONE_S)
        alone = nodes[0].status()
        assert (alone["updates"], alone["applied_samples"], alone["pending_samples"]) == (0, 0, 0), alone
        assert "Waiting for 2 nodes before training on local data (1 so far)" in nodes[0].output()

        nodes.append(NodeProcess("B", args, run_id, initial_peers=maddrs))
        nodes[1].wait_ready()
        assert "(epoch 0)" in nodes[1].output()  # the founder had made no update: one start for both
        # which B built itself: no download, the founder's bytes
        assert nodes[1].status()["first_state"] == "own state", nodes[1].status()
        assert "Loading the swarm's parameters" not in nodes[1].output()
        assert nodes[1].digests()[1] == nodes[0].digests()[1]
        wait_until(lambda: min(n.status()["updates"] for n in nodes) >= 2, 120, "two updates of the pair", 0.5)
        for node in nodes:
            assert "2 nodes in the swarm (--wait-for-peers 2): training on local data starts" in node.output()
            assert node.status()["applied_samples"] > 0
