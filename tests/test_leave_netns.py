"""A node whose network goes away with its process still running (a laptop closed, a Wi-Fi that drops): real nodes
in network namespaces, the leaver's cable pulled at the switch.

A, B and C train a sparse low-communication swarm over shaped links. Right after a round of all three, C's port on
the segment goes down: C's process, its DHT and its p2pd live on, but nothing reaches them and C reaches nobody.
C's leaving may cost A and B the one round that counts it; their later rounds are theirs. When the port comes back, C
must serve the swarm's bytes again (by replay or a download), never a step's number with bytes A and B did not have.
"""
from __future__ import annotations

import re
import time

import pytest

from tests import netns
from tests.nodeproc import TINY_CONFIG, maddrs_on, new_run_id, shown_on_failure, start_in, wait_until

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None,
                                                    reason=f"network namespaces unavailable: {REASON}")]

RATE_MBIT = 8
INNER = 4
TIMEOUTS = ["--matchmaking-time", "5", "--request-timeout", "3", "--averaging-timeout", "15"]
STAMP = re.compile(r"^(\w{3} +\d+ \d\d:\d\d:\d\d\.\d{3}) ", re.M)
UPDATE = re.compile(r"\] update (\d+): .* (\d+) peers?, ")
FAILED = re.compile(r"Gradient averaging failed|such rounds so far")


def updates_after(log: str, t0: float) -> list[tuple[float, int, int]]:
    """(time, update, peers) of each update `log` made after t0 (time.time())."""
    from tests.test_join_netns import stamp
    out = []
    for line in log.splitlines():
        m = UPDATE.search(line)
        if m and STAMP.match(line) and stamp(line) >= t0:
            out.append((stamp(line), int(m.group(1)), int(m.group(2))))
    return out


def failures_after(log: str, t0: float) -> list[str]:
    from tests.test_join_netns import stamp
    return [line for line in log.splitlines() if FAILED.search(line) and STAMP.match(line) and stamp(line) >= t0]


def test_a_node_that_loses_its_network_costs_the_others_at_most_one_round(tmp_path):
    text = tmp_path / "train.txt"
    from tests.texts import write_shakespeare
    write_shakespeare(text, 30_000)
    args = ["--model-config", str(TINY_CONFIG), "--train-data", str(text), "--local-batch-size", "2",
            "--local-seq-len", "32", "--sync", "low-comm", "--inner-steps", str(INNER), "--wire-codec", "sparse",
            "--topk-fraction", "0.01", *TIMEOUTS]
    run_id, nodes = new_run_id(), []
    with netns.Net() as net:
        hosts = {name: net.host(name.lower(), rate_mbit=RATE_MBIT) for name in "ABC"}
        with shown_on_failure(nodes):
            a = start_in(hosts["A"], "A", args, run_id)
            nodes.append(a)
            a.wait_ready()
            peers = maddrs_on(a, hosts["A"])
            for name in "BC":
                node = start_in(hosts[name], name, args, run_id, peers)
                nodes.append(node)
                node.wait_ready(240)
            b, c = nodes[1], nodes[2]
            wait_until(lambda: re.search(r"\] update \d+: .* 3 peers, ", c.output()), 240, "a round of all three", 1.0)
            switch, port = hosts["C"].port
            netns._ip("-n", switch, "link", "set", port, "down")
            cut = time.time()
            print(f"C's port down at update {a.status()['updates']} of A")
            wait_until(lambda: sum(1 for _, _, n in updates_after(a.output(), cut) if n == 2) >= 3, 240,
                       "three rounds of A and B without C", 1.0)
            a_fail, b_fail = failures_after(a.output(), cut), failures_after(b.output(), cut)
            print("A after the cut:", updates_after(a.output(), cut), a_fail)
            print("B after the cut:", updates_after(b.output(), cut), b_fail)
            netns._ip("-n", switch, "link", "set", port, "up")
            back = time.time()
            wait_until(lambda: any(n == 3 for _, _, n in updates_after(c.output(), back)), 240,
                       "C back in a round of three", 1.0)
            step = c.status()["step"]
            wait_until(lambda: step in a.digests() and step in c.digests(), 60, f"digests of step {step}", 0.5)
            assert c.digests()[step] == a.digests()[step]
            assert len(a_fail) <= 1 and len(b_fail) <= 1, (a_fail, b_fail)
