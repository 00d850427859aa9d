"""A joiner of a sparse low-communication swarm downloads the state in ranges from two donors at once
(node.lowcomm.statefetch, --state-donors), and finishes from the other when one dies mid-download: it serves the
swarm's bytes without hivemind's download from one peer.

A and B train in rounds; each one's link is shaped to RATE_MBIT (a home uplink, tests.netns with tbf), so the
joiner's download takes seconds and B can be killed in the middle of it. C's link is not shaped (a home downlink is
several times its uplink).
"""
from __future__ import annotations

import re
import time

import pytest

from tests import netns
from tests.nodeproc import maddrs_on, new_run_id, shown_on_failure, start_in, wait_until
from tests.test_lowcomm_catchup import sparse_args

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None,
                                                    reason=f"network namespaces unavailable: {REASON}")]

RATE_MBIT = 8  # the tiny model's state, 13 MB, takes about 7 s from two donors at this rate, 14 s from one
KILL_AFTER_S = 2.0  # after C begins to download: B has sent C a few of its ranges
DOWNLOADED = re.compile(r"Downloaded the state of epoch (\d+) in ranges from (\d+) donors .*ranges per donor: (.*)\)")


@pytest.mark.timeout(300)
def test_a_joiner_downloads_ranges_from_two_donors_and_finishes_from_one_when_the_other_dies(tmp_path):
    args = [*sparse_args(tmp_path), "--state-donors", "2", "--wait-for-peers", "2"]
    run_id, nodes = new_run_id(), []
    with netns.Net() as net:
        hosts = {"A": net.host("a", rate_mbit=RATE_MBIT), "B": net.host("b", rate_mbit=RATE_MBIT), "C": net.host("c")}

        def start(name, peers=()):
            nodes.append(start_in(hosts[name], name, args, run_id, peers))
            return nodes[-1]

        with shown_on_failure(nodes):
            a = start("A")
            a.wait_ready()
            peers = maddrs_on(a, hosts["A"])
            b = start("B", peers)
            b.wait_ready()
            # A and B start together (--wait-for-peers 2: neither trains alone); C joins once both serve the
            # swarm's epochs, averaging rounds
            wait_until(lambda: all("Averaged gradients with 2 peers" in n.output() for n in nodes), 150,
                       "a round of A and B together", 0.5)
            b_id, a_id = b.status()["peer_id"], a.status()["peer_id"]
            c = start("C", peers)
            wait_until(lambda: "ranges of the state" in c.output(), 120, "C to begin its download", 0.2)
            assert b_id in c.output().split("ranges of the state")[1].splitlines()[0]  # B is one of the donors
            time.sleep(KILL_AFTER_S)
            b.kill()
            c.wait_ready(180)
            found = DOWNLOADED.search(c.output())
            assert found, "C did not download the state in ranges"
            per_donor = dict(item.rsplit(" ", 1) for item in found.group(3).split(", "))
            assert set(per_donor) == {a_id, b_id} and int(per_donor[b_id]) >= 1, per_donor
            assert re.search(rf"Donor {b_id} failed", c.output()), "B's death went unnoticed"
            assert "Loading the swarm's parameters and optimizer state from peers" not in c.output()
            # C serves the bytes A serves for the same step (a node's first published step after the download)
            first = min(c.digests())
            wait_until(lambda: first in a.digests(), 60, f"A's digest of step {first}", 0.5)
            assert c.digests()[first] == a.digests()[first]
