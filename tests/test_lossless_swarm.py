"""Every accepted gradient reaches the model, with 2 and 3 nodes and no tuning of when the swarm updates.

Real nodes on 127.0.0.1, contributors submitting over real HTTP from threads on every node at about the same time,
each packet on coordinates no other packet touches. With weight decay 0, AdamW moves a coordinate only if some
update applied a gradient on it, so a packet whose coordinates did not move on every node was lost. Throughout,
every node's served step and digest are polled: equal steps must mean equal bytes.
"""
from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from tests.nodeproc import (PER_STEP, TINY_CONFIG, NodeProcess, new_run_id, shown_on_failure, start_swarm,
                            wait_until)
from tests.swarmcheck import TENSOR, ByteWatch, Contributions, all_applied, tensor_f32

pytestmark = pytest.mark.swarm

ROUNDS = 3
PER_NODE = 2  # contributors per node per round


@pytest.fixture
def no_decay(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"learning_rate": 0.01, "weight_decay": 0.0, "min_nodes_for_update": 1}))
    return [*PER_STEP, "--model-config", str(TINY_CONFIG), "--train-config", str(path)]


def _assert_every_packet_moved(nodes, contributions: Contributions, before: np.ndarray) -> None:
    for node in nodes:
        _, after = tensor_f32(node, TENSOR)
        lost = [(name, coords.tolist()) for name, coords in contributions.accepted
                if np.any(after[coords] == before[coords])]
        assert not lost, f"node {node.name}: {len(lost)} of {len(contributions.accepted)} accepted packets " \
                         f"moved no coordinate: {lost[:3]}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("peers", [2, 3])
def test_every_accepted_packet_is_applied_on_every_node(no_decay, peers):
    nodes = start_swarm(peers, no_decay, new_run_id())
    with shown_on_failure(nodes):
        _, before = tensor_f32(nodes[0], TENSOR)
        contributions = Contributions(tensor_elements=before.size)
        rng = random.Random(peers)
        with ByteWatch(nodes) as watch:
            for r in range(ROUNDS):
                contributions.round(nodes, PER_NODE, tag=f"r{r}")
                time.sleep(rng.uniform(0.0, 3.0))
            wait_until(lambda: all_applied(nodes), 180, "every accepted packet applied, one step on every node", 1.0)
        statuses = [n.status() for n in nodes]
        print(f"{peers} nodes: {len(contributions.accepted)} packets accepted; steps served "
              f"{sorted(watch.served)}; carried packets {[s['carried_packets'] for s in statuses]}")
        assert not watch.conflicts, watch.conflicts[:5]
        assert sum(s["accepted_packets"] for s in statuses) == len(contributions.accepted) == ROUNDS * PER_NODE * peers
        assert sum(s["applied_packets"] for s in statuses) == len(contributions.accepted)
        _assert_every_packet_moved(nodes, contributions, before)
        for node in nodes:
            node.terminate()


@pytest.mark.timeout(480)
def test_a_killed_peer_costs_nothing_accepted_and_returns_with_the_swarms_bytes(no_decay, tmp_path):
    run_id = new_run_id()
    ckpt = ["--checkpoint-dir", str(tmp_path / "c"), "--checkpoint-every", "1"]
    # B and C join A together; C keeps checkpoints, to come back from after it is killed
    nodes = start_swarm(3, no_decay, run_id, args_of={"C": [*no_decay, *ckpt]})
    c = nodes[2]
    everyone = list(nodes)
    with shown_on_failure(everyone):
        _, before = tensor_f32(nodes[0], TENSOR)
        contributions = Contributions(tensor_elements=before.size)
        with ByteWatch(nodes) as watch:
            contributions.round(nodes, PER_NODE, tag="all")
            wait_until(lambda: all_applied(nodes), 180, "the first round applied on all three", 1.0)
            c.kill()
            survivors = nodes[:2]
            killed_at = time.monotonic()
            contributions.round(survivors, PER_NODE, tag="after-kill")
            wait_until(lambda: all_applied(survivors), 180, "the survivors to apply every packet", 1.0)
            print(f"survivors applied every packet {time.monotonic() - killed_at:.1f}s after the kill")
            contributions.round(survivors, PER_NODE, tag="later")
            wait_until(lambda: all_applied(survivors), 180, "a later round", 1.0)
            # C returns from its checkpoint: it serves the swarm's step, with the swarm's bytes, from its first line
            c2 = NodeProcess("C2", [*no_decay, *ckpt], run_id, initial_peers=nodes[0].wait_ready())
            everyone.append(c2)
            watch.add(c2)
            c2.wait_ready()
            first_step, first_digest = min(c2.digests().items())
            wait_until(lambda: first_step in nodes[0].digests(), 60, "A to have served that step")
            assert nodes[0].digests()[first_step] == first_digest, c2.output()[-3000:]
            contributions.round([*survivors, c2], PER_NODE, tag="back")
            wait_until(lambda: all_applied([*survivors, c2]), 180, "a round with C back", 1.0)
        assert not watch.conflicts, watch.conflicts[:5]
        _assert_every_packet_moved([*survivors, c2], contributions, before)
