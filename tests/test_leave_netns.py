"""A node whose network goes away while its process runs (a laptop closed, a Wi-Fi that drops): real nodes in network
namespaces, the leaver's cable pulled at the switch and plugged in again.

A, B and C train a sparse low-communication swarm over shaped links. Right after a round of all three, C's port on
the segment goes down for CUT_S: C's process, its DHT and its p2pd live on, but nothing reaches them and C reaches
nobody, for longer than C's failed rounds are carried and than its connections and routing table keep A and B.
- A and B go on: C's leaving costs each at most the one round that counted it.
- C makes no update alone once it finds it reaches neither (node.swarm.contact): alone, it would run its epoch ahead
  of theirs, and when the port came back they would take its bytes for the swarm's.
- When the port comes back, C dials A and B again (nothing else would: their DHTs forgot each other), finds itself
  behind, catches up, and averages a round with both; it serves A's bytes for the same step.
"""
from __future__ import annotations

import re
import time

import pytest

from tests import netns
from tests.nodeproc import maddrs_on, new_run_id, shown_on_failure, start_in, wait_until
from tests.test_join_netns import sparse_swarm_args, stamp

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.timeout(420),
              pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")]

RATE_MBIT = 8
CUT_S = 40.0  # more than C's carried rounds (three failures, at the averaging timeout below) and its connections last
TIMEOUTS = ["--matchmaking-time", "5", "--request-timeout", "3", "--averaging-timeout", "8"]
UPDATE = re.compile(r"\] update (\d+): .* (\d+) peers, ")
FAILED = re.compile(r"Gradient averaging failed|Gradient round failed")
ISOLATED = "reaches none of the 2 peers it trained with"


def updates(log: str, since: float, until: float = float("inf")) -> list[tuple[int, int]]:
    """(update, peers) of each update `log` made between `since` and `until` (time.time())."""
    return [(int(m.group(1)), int(m.group(2))) for line in log.splitlines()
            if (m := UPDATE.search(line)) and since <= stamp(line) <= until]


def failures(log: str, since: float) -> list[str]:
    return [line for line in log.splitlines() if FAILED.search(line) and stamp(line) >= since]


def test_a_node_that_loses_its_network_costs_the_others_one_round_and_comes_back_behind(tmp_path):
    args = sparse_swarm_args(tmp_path, TIMEOUTS)  # the tiny model, --inner-steps 4 (INNER there)
    run_id, nodes = new_run_id(), []
    with netns.Net() as net:
        hosts = {name: net.host(name.lower(), rate_mbit=RATE_MBIT) for name in "ABC"}
        with shown_on_failure(nodes):
            a = start_in(hosts["A"], "A", args, run_id)
            nodes.append(a)
            a.wait_ready()
            peers = maddrs_on(a, hosts["A"])
            for name in "BC":
                nodes.append(start_in(hosts[name], name, args, run_id, peers))
                nodes[-1].wait_ready(240)
            b, c = nodes[1], nodes[2]
            wait_until(lambda: any(n == 3 for _, n in updates(c.output(), 0)), 240, "a round of all three", 1.0)
            switch, port = hosts["C"].port
            netns._ip("-n", switch, "link", "set", port, "down")
            cut = time.time()
            try:
                wait_until(lambda: ISOLATED in c.output(), CUT_S, "C finding itself cut off", 1.0)
                time.sleep(max(0.0, cut + CUT_S - time.time()))
            finally:
                netns._ip("-n", switch, "link", "set", port, "up")
            back = time.time()
            during = {node.name: updates(node.output(), cut, back) for node in nodes}
            wait_until(lambda: any(n == 3 for _, n in updates(c.output(), back)), 180, "C back in a round of three",
                       1.0)
            step = c.status()["step"]
            wait_until(lambda: step in a.digests() and step in c.digests(), 60, f"digests of step {step}", 0.5)
            a_log, b_log, c_log = a.output(), b.output(), c.output()

            # A and B trained on together: rounds of two, and at most the one round that counted C failed
            assert sum(1 for _, n in during["A"] if n == 2) >= 5, during["A"]
            assert len(failures(a_log, cut)) <= 1 and len(failures(b_log, cut)) <= 1, (
                failures(a_log, cut), failures(b_log, cut))
            for log in (a_log, b_log):  # and neither took C's bytes for the swarm's
                loads = [line for line in log.splitlines() if "Loading the swarm's parameters" in line
                         and stamp(line) >= cut]
                assert loads == [], loads
            # C made no update alone once it knew it was cut off (one before that, on its third failed round, at most)
            isolated_at = next(stamp(line) for line in c_log.splitlines() if ISOLATED in line)
            assert [u for u in updates(c_log, isolated_at, back) if u[1] == 1] == [], updates(c_log, cut, back)
            assert len(during["C"]) <= 1, during["C"]
            # back behind the swarm, never ahead of it: it caught up, and its bytes are the swarm's
            assert "Behind the swarm" in c_log[c_log.index(ISOLATED):]
            assert "This node reaches its peers again" in c_log
            assert c.digests()[step] == a.digests()[step]
