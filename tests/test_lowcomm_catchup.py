"""A node that joins a sparse low-communication swarm over a slow link catches up by replaying rounds
(node.lowcomm.roundlog): its state download takes longer than the swarm's rounds, so it ends rounds behind; it then
fetches only what those rounds applied from a peer, computes the swarm's state of the current epoch exactly, and
trains with the others, every node serving the same bytes for the same step.

A and B share a segment with unlimited links; C is a home node: behind a NAT router, so it joins as a client-mode
peer (it dials out only, and swaps payloads with A and B by dialing them), its link shaped to RATE_MBIT both ways
(tests.netns, tbf).
"""
from __future__ import annotations

import re

import pytest

from tests import netns
from tests.nodeproc import TINY_CONFIG, maddrs_on, new_run_id, shown_on_failure, start_in, wait_until
from tests.swarmcheck import ByteWatch
from tests.texts import shakespeare

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None,
                                                    reason=f"network namespaces unavailable: {REASON}")]

RATE_MBIT = 4  # C's state (parameters and outer momentum, about 13 MB) takes 25 s and more; a round, a few seconds
INNER = 4
REPLAYED = re.compile(r"Caught up from epoch (\d+) to (\d+) by replaying (\d+) rounds")


def sparse_args(tmp_path) -> list[str]:
    """A tiny model trained on a text of its own in sparse low-comm rounds of INNER inner updates."""
    text = tmp_path / "train.txt"
    text.write_text(shakespeare(30_000))
    return ["--model-config", str(TINY_CONFIG), "--train-data", str(text), "--local-batch-size", "2",
            "--local-seq-len", "32", "--sync", "low-comm", "--inner-steps", str(INNER), "--wire-codec", "sparse",
            "--topk-fraction", "0.01"]


@pytest.mark.timeout(420)
def test_a_joiner_over_a_slow_link_catches_up_by_replaying_rounds(tmp_path):
    args = sparse_args(tmp_path)
    run_id, nodes = new_run_id(), []
    with netns.Net() as net:
        router = net.nat_router()
        hosts = {"A": net.host("a"), "B": net.host("b"), "C": net.host("c", rate_mbit=RATE_MBIT, behind=router)}

        def start(name, peers=()):
            nodes.append(start_in(hosts[name], name, args, run_id, peers))
            return nodes[-1]

        with shown_on_failure(nodes):
            a = start("A")
            a.wait_ready()
            peers = maddrs_on(a, hosts["A"])
            start("B", peers).wait_ready()
            wait_until(lambda: min(n.status()["updates"] for n in nodes) >= 2, 120, "two rounds of A and B", 0.5)
            c = start("C", peers)
            c.wait_ready(240)
            assert c.status()["reachability"]["mode"] == "client", c.status()["reachability"]
            wait_until(lambda: REPLAYED.search(c.output()), 180, "C catching up by replay", 1.0)
            behind = [tuple(map(int, m.groups())) for m in REPLAYED.finditer(c.output())]
            assert all(to - have == count and count >= 1 for have, to, count in behind), behind
            with ByteWatch(nodes, interval_s=0.5) as watch:
                # caught up, C trains its inner steps while A and B may begin the next round without it (the
                # swarm waits for no one); it joins one once its steps are done in time
                wait_until(lambda: "Averaged gradients with 3 peers" in c.output(), 150, "a round with C", 1.0)
                start_step = max(n.status()["step"] for n in nodes)
                wait_until(lambda: min(n.status()["step"] for n in nodes) >= start_step + 2, 150,
                           "two more rounds", 1.0)
            assert not watch.conflicts, watch.conflicts[:5]
            # every replay gave the bytes the peers publish (a round that failed while C joined, each node updating
            # alone, is the agreement's to repair, as in any swarm)
            assert "did not give the bytes the swarm serves" not in c.output()
