"""Nobody waits for a downloading peer: real nodes in network namespaces, every link shaped with tbf.

A founds a sparse low-communication swarm and trains; B joins over a shaped link and downloads the state while A
goes on; B trains with A, is killed (SIGKILL) and comes back with the same identity while its progress record of
before is still in the DHT (it lives a minute), downloading again. B's leaving may cost A the one round that looks
for B's gradient (hivemind's "could not find a group"), no more: once A finds B's process ended (its dial refused),
its next round no longer counts B's record and is an update alone. During each of B's downloads (from its log's
"Downloading ... ranges of the state" to "Downloaded the state"), A's own log and polled status must show updates,
and A must not have looked for a group that never formed (its round counting B as a member while B downloaded). B,
back, must serve A's bytes and average a round with it.
"""
from __future__ import annotations

import re
import time
from datetime import datetime

import pytest

from dtrain.node.swarm.presence import ANNOUNCE_EVERY_S
from tests import netns
from tests.nodeproc import TINY_CONFIG, maddrs_on, new_run_id, shown_on_failure, start_in, wait_until
from tests.sampler import Sampler

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None,
                                                    reason=f"network namespaces unavailable: {REASON}")]

RATE_MBIT = 4  # every link, both ways: the tiny model's state (about 13 MB) takes 25 s and more, a round a few seconds
INNER = 4
# the defaults for gathering a group and for one request (the harness's own are shorter). A round that waits for a
# member that never comes (B, killed) waits out --averaging-timeout: half the default, three times the matchmaking
TIMEOUTS = ["--matchmaking-time", "5", "--request-timeout", "3", "--averaging-timeout", "15"]
STAMP = re.compile(r"^(\w{3} +\d+ \d\d:\d\d:\d\d\.\d{3}) ")
# a download in ranges from every peer that serves the state (the default, node.lowcomm.statefetch), or from one
BEGIN = re.compile(r"Downloading \d+ ranges of the state|Downloading the state from peer")
END = re.compile(r"Downloaded the state (of epoch \d+ in ranges|from \S+) |The download from \S+ failed")
UPDATE = re.compile(r"\] update (\d+): ")
# the node's line, one per round: carried (no update) or, once it has carried its limit, an update alone
NO_GROUP = re.compile(r"Gradient (round|averaging) failed \(.*could not find a group")
TOGETHER = re.compile(r"\] update (\d+): .* 2 peers, ")  # an update of a round that averaged two peers
ALONE = re.compile(r"\] update (\d+): .* 1 peers, ")  # an update of this node alone
MIN_WINDOW_S = 10.0  # a download shorter than this says nothing about the founder's pace
CAUGHT_UP = re.compile(r"Caught up from epoch \d+ to \d+ by replaying")
READY = re.compile(r"Node ready at step")


def stamp(line: str) -> float:
    m = STAMP.match(line)
    year = datetime.now().year
    return datetime.strptime(f"{year} {m.group(1)}", "%Y %b %d %H:%M:%S.%f").timestamp() if m else float("nan")


def windows(output: str) -> list[tuple[float, float]]:
    """(start, end) of every download of the state in a node's log."""
    found, begun = [], None
    for line in output.splitlines():
        if BEGIN.search(line) and begun is None:
            begun = stamp(line)
        elif END.search(line) and begun is not None:
            found.append((begun, stamp(line)))
            begun = None
    return found


def stamped(output: str, pattern: re.Pattern) -> list[float]:
    return [stamp(line) for line in output.splitlines() if pattern.search(line)]


def ready_after_state(output: str) -> float:
    """Seconds from a joiner's state (its download's end, or the replay after it) to its "Node ready"."""
    ready = stamped(output, READY)[0]
    return ready - max(t for t in stamped(output, END) + stamped(output, CAUGHT_UP) if t <= ready)


def sparse_swarm_args(tmp_path, timeouts) -> list[str]:
    """A tiny sparse low-comm node training on its own text (written under tmp_path), with `timeouts`."""
    text = tmp_path / "train.txt"
    from tests.texts import write_shakespeare
    write_shakespeare(text, 30_000)
    return ["--model-config", str(TINY_CONFIG), "--train-data", str(text), "--local-batch-size", "2",
            "--local-seq-len", "32", "--sync", "low-comm", "--inner-steps", str(INNER), "--wire-codec", "sparse",
            "--topk-fraction", "0.01", *timeouts]


@pytest.mark.timeout(600)
def test_the_founder_keeps_training_while_a_joiner_downloads_and_when_it_comes_back(tmp_path):
    args = sparse_swarm_args(tmp_path, TIMEOUTS)
    b_args = [*args, "--identity-path", str(tmp_path / "b.identity")]
    run_id, nodes = new_run_id(), []
    with netns.Net() as net:
        hosts = {"A": net.host("a", rate_mbit=RATE_MBIT), "B": net.host("b", rate_mbit=RATE_MBIT)}
        with shown_on_failure(nodes):
            a = start_in(hosts["A"], "A", args, run_id)
            nodes.append(a)
            a.wait_ready()
            peers = maddrs_on(a, hosts["A"])
            wait_until(lambda: a.status()["updates"] >= 2, 120, "A's first updates", 0.5)
            with Sampler(lambda: a.status()["updates"], 0.5) as polled:  # the founder's, from this process
                b = start_in(hosts["B"], "B", b_args, run_id, peers)
                nodes.append(b)
                b.wait_ready(240)
                assert b.status()["first_state"] == "download"
                together = wait_until(lambda: TOGETHER.search(b.output()), 180, "a round of A and B", 1.0)
                left_at = int(together.group(1))  # B leaves right after it: A's next round may still count it
                wait_until(lambda: a.status()["updates"] >= left_at, 60, f"A's update {left_at}", 0.2)
                first_b = b.output()
                b_id = b.status()["peer_id"]
                b.kill()
                killed = time.time()
                # B's records (its progress at the epoch it left at) live on in the DHT for up to a minute; A's round
                # at that epoch may wait for it (the one round a leaving node costs), no later one: B comes back as
                # soon as A has made an update without it, while its old records are still there (an update of A's
                # after the kill may still be a round with B: the kill can land inside one)
                wait_until(lambda: any(t >= killed for t in stamped(a.output(), ALONE)), 120,
                           "A's update without B", 0.2)
                back = start_in(hosts["B"], "B2", b_args, run_id, peers)
                nodes.append(back)
                back.wait_ready(240)
                assert back.status()["peer_id"] == b_id  # the same identity
                wait_until(lambda: "Averaged gradients with 2 peers" in back.output(), 180,
                           "a round of A and B, back", 1.0)
            a_log = a.output()
            a_updates, a_no_group = stamped(a_log, UPDATE), stamped(a_log, NO_GROUP)
            # A trained alone: B's first request for ranges tells it that it is not (no wait for its announcement to
            # be read), and what A updated during the download was in its round log, which brought the ranges forward
            assert "may take itself for alone" not in first_b
            assert re.search(r"Downloaded the state of epoch \d+ in ranges", first_b), windows(first_b)
            downloads = windows(first_b) + windows(back.output())
            assert len(windows(first_b)) >= 1 and len(windows(back.output())) >= 1, downloads
            timed = [(s, e) for s, e in downloads if e - s >= MIN_WINDOW_S]
            assert timed, f"no download of {MIN_WINDOW_S:g}s or more: {downloads}"
            for start, end in timed:
                in_log = sum(1 for t in a_updates if start <= t <= end)
                in_status = polled.increase(start, end)
                waited = [t for t in a_no_group if start <= t <= end]
                assert in_log >= 1 and in_status >= 1, (
                    f"A made {in_log} updates (log) / {in_status} (status) during B's {end - start:.0f}s download")
                assert not waited, f"A's round looked for a group that never formed during B's download: {waited}"
            # B's leaving cost A at most one round, B's downloads while back none
            waited = [t for t in a_no_group if t >= killed]
            assert len(waited) <= 1, f"A looked for a group without B {len(waited)} times after B left"
            assert "previous round results were not used" not in a_log  # hivemind's warning after a failed round
            # a joiner that downloaded trains at once (announced all along, counted by its progress record): no wait
            # for its announcement to be read, in which the others' round closed without it
            for joiner in (first_b, back.output()):
                assert ready_after_state(joiner) < ANNOUNCE_EVERY_S
            # back, B serves the bytes A serves for the same step
            step = back.status()["step"]
            wait_until(lambda: step in a.digests() and step in back.digests(), 60, f"both digests of step {step}", 0.5)
            assert back.digests()[step] == a.digests()[step]
