"""Who is in the swarm (node.swarm.presence), between real DHT peers on 127.0.0.1: a node that downloads the state
stays announced for as long as the download takes, longer than its record lives; the training thread's refresh
waits for no read."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest

from dtrain.node.swarm import presence as presence_module
from dtrain.node.swarm import records
from dtrain.node.swarm.presence import Presence
from dtrain.node.swarm.records import RecordOwner
from tests.nodeproc import new_run_id
from tests.test_commit import signed_dht

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

TTL_S = 2.0  # records live this long here (a node's live RECORD_TTL_S)


@contextlib.contextmanager
def two_nodes(epoch=lambda: -1):
    """The presence of two nodes of one run, each on a DHT of its own, at `epoch`."""
    run_id = new_run_id()
    owners = [RecordOwner.generate() for _ in range(2)]
    dhts = [signed_dht(owners[0])]
    try:
        dhts.append(signed_dht(owners[1], initial_peers=dhts[0].get_visible_maddrs()))
        yield tuple(Presence(d, run_id, o, [str(m) for m in d.get_visible_maddrs()], bridge_port=8000, epoch=epoch)
                    for d, o in zip(dhts, owners))
    finally:
        for d in reversed(dhts):
            d.shutdown()


def test_a_node_stays_announced_while_it_downloads_and_goes_after(monkeypatch):
    monkeypatch.setattr(records, "RECORD_TTL_S", TTL_S)
    monkeypatch.setattr(presence_module, "ANNOUNCE_EVERY_S", 0.5)
    with two_nodes() as (donor, joiner):
        with joiner.announcing(step=0):
            time.sleep(3 * TTL_S)  # a download: three lifetimes of a record, and the training thread refreshes nothing
            assert joiner.peer_id in donor.refresh(step=7, pending_samples=0)
            assert not donor.alone()
        time.sleep(TTL_S + 1.0)  # done: no more announcements, and the last one expired
        assert joiner.peer_id not in donor.refresh(step=7, pending_samples=0)
        assert donor.alone()


def test_a_download_is_announced_as_one_and_a_replay_at_the_node_s_epoch(monkeypatch):
    # a download counts the node out of every round (epoch -1); a replay leaves it the late peer the others wait for
    monkeypatch.setattr(records, "RECORD_TTL_S", TTL_S)
    monkeypatch.setattr(presence_module, "ANNOUNCE_EVERY_S", 0.5)
    with two_nodes(epoch=lambda: 6) as (donor, joiner):
        for downloading, epoch in ((True, -1), (False, 6)):
            with joiner.announcing(step=7, downloading=downloading):
                time.sleep(2 * TTL_S)  # announced again by its thread, after the first record expired
                assert donor.refresh(step=9, pending_samples=0)[joiner.peer_id].epoch == epoch


def test_keep_fresh_waits_for_no_read_and_a_failed_read_leaves_the_view(monkeypatch):
    """The training thread's refresh: it announces and returns while the read of the others' announcements is held
    up (as behind an uplink a state download fills); the view is the read's once it answers, and a read that fails
    is not taken for an empty swarm."""
    monkeypatch.setattr(presence_module, "ANNOUNCE_EVERY_S", 0.2)
    released, failing = threading.Event(), threading.Event()
    real_lookup = records.lookup

    def held_lookup(dht, key, timeout_s=records.TIMEOUT_S):
        released.wait(30)
        return None if failing.is_set() else real_lookup(dht, key, timeout_s)

    try:
        with two_nodes() as (node, other):
            other.refresh(step=3, pending_samples=0)
            monkeypatch.setattr(records, "lookup", held_lookup)
            started = time.monotonic()
            node.keep_fresh(step=3, pending_samples=5)
            assert time.monotonic() - started < 0.5 and node.nodes == {}  # the read is held: nothing seen yet
            released.set()
            deadline = time.monotonic() + 10
            while other.peer_id not in node.nodes and time.monotonic() < deadline:
                time.sleep(0.05)
            assert set(node.nodes) == {node.peer_id, other.peer_id}
            assert node.nodes[node.peer_id].pending_samples == 5 and node.nodes[other.peer_id].step == 3
            failing.set()  # every later read fails: the view stays
            for _ in range(3):
                time.sleep(0.3)
                node.keep_fresh(step=4, pending_samples=0)
            time.sleep(0.5)
            assert other.peer_id in node.nodes and not node.alone()
    finally:
        released.set()
