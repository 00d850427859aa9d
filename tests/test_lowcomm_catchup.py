"""Joining a sparse low-communication swarm, in one swarm of real nodes in network namespaces:

- B joins A at epoch 0 (both wait for each other before they train): its own seeded state is the swarm's start, so
  it takes no download and serves A's bytes.
- C, a home node, joins over a slow link and catches up by replaying rounds (node.lowcomm.roundlog): its state
  download from one peer (--state-donors 0) takes longer than the swarm's rounds, so it ends rounds behind; it
  collects the records of those rounds while it downloads, computes the swarm's state of the current epoch exactly from them, and trains with the
  others, every node serving the same bytes for the same step.
- D joins with --state-donors 2 and downloads the state in ranges from A and B at once (node.lowcomm.statefetch);
  B is killed in the middle of it, D finishes from A and serves the swarm's bytes without hivemind's download from
  one peer.

A, B and D share a segment with unlimited links; C is behind a NAT router, so it joins as a client-mode peer (it
dials out only, and swaps payloads with A and B by dialing them), its link shaped to RATE_MBIT both ways
(tests.netns, tbf). Before D joins, A's and B's links are shaped to DONOR_RATE_MBIT (home uplinks), so that D's
download takes seconds and B can be killed in the middle of it; D's is not (a home downlink is several times its
uplink).
"""
from __future__ import annotations

import re
import time

import pytest

from tests import netns
from tests.nodeproc import TINY_CONFIG, maddrs_on, new_run_id, shown_on_failure, start_in, wait_until
from tests.swarmcheck import ByteWatch
from tests.texts import shakespeare

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None,
                                                    reason=f"network namespaces unavailable: {REASON}")]

RATE_MBIT = 4  # C's state (parameters and outer momentum, about 13 MB) takes 25 s and more
# unpaced, the tiny model's rounds come about a second apart (they begin as soon as every node is done) and this test
# takes 215 s instead of 140 on two cores
MIN_ROUND_S = 3
DONOR_RATE_MBIT = 8  # D's state, 13 MB, takes about 7 s from two donors at this rate, 14 s from one
KILL_AFTER_S = 2.0  # after D begins to download: B has sent D a few of its ranges
INNER = 4
REPLAYED = re.compile(r"Caught up from epoch (\d+) to (\d+) by replaying (\d+) rounds"
                      r"(?: \((\d+) collected while it downloaded\))?")
DOWNLOADED = re.compile(r"Downloaded the state of epoch (\d+) in ranges from (\d+) donors .*ranges per donor: (.*)\)")
ONE_PEER_DOWNLOAD = "Loading the swarm's parameters and optimizer state from peers"


def sparse_args(tmp_path) -> list[str]:
    """A tiny model trained on a text of its own in sparse low-comm rounds of INNER inner updates."""
    text = tmp_path / "train.txt"
    text.write_text(shakespeare(30_000))
    return ["--model-config", str(TINY_CONFIG), "--train-data", str(text), "--local-batch-size", "2",
            "--local-seq-len", "32", "--sync", "low-comm", "--inner-steps", str(INNER), "--wire-codec", "sparse",
            "--topk-fraction", "0.01", "--min-round-seconds", str(MIN_ROUND_S)]


@pytest.mark.timeout(600)
def test_joiners_take_the_start_as_built_catch_up_by_replay_and_download_ranges_from_two_donors(tmp_path):
    args = sparse_args(tmp_path)
    # A and B start together (--wait-for-peers 2: neither trains alone) and donate ranges of their state
    donor_args = [*args, "--state-donors", "2", "--wait-for-peers", "2"]
    run_id, nodes = new_run_id(), []
    with netns.Net() as net:
        router = net.nat_router()
        hosts = {"A": net.host("a"), "B": net.host("b"), "C": net.host("c", rate_mbit=RATE_MBIT, behind=router),
                 "D": net.host("d")}

        def start(name, node_args, peers=()):
            nodes.append(start_in(hosts[name], name, node_args, run_id, peers))
            return nodes[-1]

        with shown_on_failure(nodes):
            a = start("A", donor_args)
            a.wait_ready()
            peers = maddrs_on(a, hosts["A"])
            b = start("B", donor_args, peers)
            b.wait_ready()
            # B joined at epoch 0 with the seeded model A started from: no download, A's bytes (once it trains, A may
            # have updated before B's first round: B then catches up as any node behind)
            assert (a.status()["first_state"], b.status()["first_state"]) == ("founder", "own state")
            joined = b.output().split("Node ready")[0]
            assert ONE_PEER_DOWNLOAD not in joined and "ranges of the state" not in joined
            assert b.digests()[1] == a.digests()[1]
            wait_until(lambda: min(n.status()["updates"] for n in nodes) >= 2, 120, "two rounds of A and B", 0.5)

            c = start("C", [*args, "--state-donors", "0"], peers)  # one peer's download, rounds collected meanwhile
            c.wait_ready(240)
            assert c.status()["reachability"]["mode"] == "client", c.status()["reachability"]
            assert c.status()["first_state"] == "download"  # the swarm was past its start
            wait_until(lambda: REPLAYED.search(c.output()), 180, "C catching up by replay", 1.0)
            behind = [tuple(int(g or 0) for g in m.groups()) for m in REPLAYED.finditer(c.output())]
            assert all(to - have == count and count >= 1 for have, to, count, _ in behind), behind
            assert behind[0][3] >= 1, behind  # the first replay, after the download: with rounds it collected
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
            c.terminate()  # D's download below is from A and B, the donors, as they train in rounds

            for donor in "AB":
                net.limit(hosts[donor], DONOR_RATE_MBIT)
            b_id, a_id = b.status()["peer_id"], a.status()["peer_id"]
            d = start("D", donor_args, peers)
            wait_until(lambda: "ranges of the state" in d.output(), 120, "D to begin its download", 0.2)
            assert b_id in d.output().split("ranges of the state")[1].splitlines()[0]  # B is one of the donors
            assert "may take itself for alone" not in d.output()  # A and B see each other: no wait before it
            time.sleep(KILL_AFTER_S)
            b.kill()
            d.wait_ready(180)
            found = DOWNLOADED.search(d.output())
            assert found, "D did not download the state in ranges"
            per_donor = dict(item.rsplit(" ", 1) for item in found.group(3).split(", "))
            assert set(per_donor) == {a_id, b_id} and int(per_donor[b_id]) >= 1, per_donor
            assert re.search(rf"Donor {b_id} failed", d.output()), "B's death went unnoticed"
            assert ONE_PEER_DOWNLOAD not in d.output()
            assert d.status()["first_state"] == "download"
            # D serves the bytes A serves for the same step (a node's first published step after the download)
            first = min(d.digests())
            wait_until(lambda: first in a.digests(), 60, f"A's digest of step {first}", 0.5)
            assert d.digests()[first] == a.digests()[first]
