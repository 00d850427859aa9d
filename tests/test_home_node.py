"""A node at home: behind a NAT router (masquerade; nothing from outside gets in), it joins a swarm of two public
nodes, finds at start that they cannot dial it back, joins as a client-mode peer, and trains with them: the packets
its contributors send are applied on all three nodes, also when only it has packets (it cannot lead a round; the
public nodes join its), and equal steps are equal bytes everywhere.

Each node runs in a network namespace of its own (tests.netns): A and B on a shared segment, the home node behind
a router on it. Contributors submit over real HTTP inside each node's namespace, each packet on coordinates no
other packet touches; with weight decay 0 a coordinate moves only if an update applied a gradient on it.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tests import netns
from tests.nodeproc import (PER_STEP, TINY_CONFIG, NodeProcess, maddrs_on, new_run_id, shown_on_failure, start_in,
                            wait_until)
from tests.swarmcheck import TENSOR, ByteWatch, Contributions, all_applied, tensor_f32

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None,
                                                    reason=f"network namespaces unavailable: {REASON}")]

ROUNDS = 3
HOME_ROUNDS = 2  # then rounds with packets at the home node only
PER_NODE = 2  # contributors per node per round


@pytest.fixture
def no_decay(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"learning_rate": 0.01, "weight_decay": 0.0, "min_nodes_for_update": 1}))
    return [*PER_STEP, "--model-config", str(TINY_CONFIG), "--train-config", str(path)]


@pytest.mark.timeout(420)
def test_node_behind_nat_joins_as_client_and_its_packets_are_applied_everywhere(no_decay):
    run_id = new_run_id()
    nodes: list[NodeProcess] = []
    with netns.Net() as net:
        router = net.nat_router()
        hosts = {"A": net.host("a"), "B": net.host("b"), "H": net.host("home", behind=router)}
        with shown_on_failure(nodes):
            a = start_in(hosts["A"], "A", no_decay, run_id)
            nodes.append(a)
            a.wait_ready()
            peers = maddrs_on(a, hosts["A"])
            assert peers, a.status()["maddrs"]
            nodes += [start_in(hosts[name], name, no_decay, run_id, peers) for name in ("B", "H")]
            for node in nodes[1:]:
                node.wait_ready()
            reach = {n.name: n.status()["reachability"] for n in nodes}
            print("reachability:", reach)
            assert reach["A"]["mode"] == "public" and reach["A"]["verdict"] == "unchecked"  # the first: no one to ask
            assert reach["B"]["mode"] == "public" and reach["B"]["verdict"] == "reachable"
            assert reach["H"]["mode"] == "client" and reach["H"]["verdict"] == "unreachable"
            assert reach["H"]["answered"] >= 1 and reach["H"]["dialed"] == 0

            _, before = tensor_f32(a, TENSOR)
            contributions = Contributions(tensor_elements=before.size)
            with ByteWatch(nodes) as watch:
                for r in range(ROUNDS):
                    contributions.round(nodes, PER_NODE, tag=f"r{r}")
                    time.sleep(1.0 + r)
                wait_until(lambda: all_applied(nodes), 240, "every accepted packet applied, one step on every node",
                           1.0)
                # packets at the home node alone: a client-mode peer cannot lead a round, the public nodes (with
                # nothing of their own) join its round; its packets are never left waiting
                home_node = nodes[2]
                for r in range(HOME_ROUNDS):
                    contributions.round([home_node], PER_NODE, tag=f"home{r}")
                    wait_until(lambda: all_applied(nodes), 120, "the home node's packets applied everywhere", 1.0)
            statuses = {n.name: n.status() for n in nodes}
            print({name: {k: s[k] for k in ("step", "accepted_packets", "applied_packets", "carried_packets",
                                             "skipped_rounds")} for name, s in statuses.items()},
                  "steps served:", sorted(watch.served))
            assert not watch.conflicts, watch.conflicts[:5]
            home = statuses["H"]
            assert home["accepted_packets"] == (ROUNDS + HOME_ROUNDS) * PER_NODE == home["applied_packets"]
            assert sum(s["applied_packets"] for s in statuses.values()) == len(contributions.accepted) \
                == ROUNDS * PER_NODE * len(nodes) + HOME_ROUNDS * PER_NODE
            assert home["step"] >= 1 and len({(s["step"], s["params_sha256"]) for s in statuses.values()}) == 1
            # every step two nodes both served has one digest (the logs keep every step each node served)
            served = [n.digests() for n in nodes]
            for step in set().union(*served):
                assert len({d[step] for d in served if step in d}) == 1, f"step {step}: {served}"
            for node in nodes:  # every packet, the home node's included, moved its coordinates on every node
                _, after = tensor_f32(node, TENSOR)
                lost = [(name, c.tolist()) for name, c in contributions.accepted if np.any(after[c] == before[c])]
                assert not lost, f"node {node.name}: {len(lost)} packets moved nothing: {lost[:3]}"
            for node in nodes:
                node.terminate()
