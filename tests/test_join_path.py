"""The join path's pure parts: a donor's bound on the state it streams (node.swarm.download.UploadPace) and which
peers a round counts (node.swarm.optimizer.PacedTracker: only those at the swarm's epoch); and, with a real DHT, the
joiner's first read of the swarm's progress."""
import logging
import threading
import time

import hivemind
import pytest
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.performance_ema import PerformanceEMA

from dtrain.node.swarm.download import UploadPace
from dtrain.node.swarm.optimizer import PacedTracker

pytestmark = pytest.mark.unit


def test_pace_holds_the_rate_after_one_burst():
    pace = UploadPace(8.0, burst_bytes=1 << 20)  # 1 MB/s
    now = time.monotonic()
    waits = [pace.delay(1 << 18, now=now) for _ in range(12)]  # 3 MiB at once
    assert waits[:4] == [0.0] * 4  # the first MiB is the burst
    assert waits[-1] == pytest.approx((12 * (1 << 18) - (1 << 20)) / 1e6, abs=1e-3)
    # a second later, a second's bytes are free again, and no more than the burst ever is
    assert pace.delay(0, now=now + 100.0) == 0.0
    assert pace.delay(2 << 20, now=now + 100.0) == pytest.approx(0.0, abs=1e-6)  # the bucket's MiB, and one MiB owed
    # the next MiB waits for the one owed: 2 MiB in a second's burst, then the rate
    assert pace.delay(1 << 20, now=now + 100.0) == pytest.approx((1 << 20) / 1e6, abs=1e-3)


def test_pace_of_zero_is_no_bound_and_bad_rates_are_refused():
    assert UploadPace(0.0).delay(1 << 30) == 0.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            UploadPace(bad)


def _tracker(local_epoch: int, key: bytes = b"me", client: bool = False) -> PacedTracker:
    tracker = PacedTracker.__new__(PacedTracker)  # the parsing only: no DHT, no thread
    tracker.prefix, tracker.target_batch_size, tracker.status_loglevel = "run", 48, logging.DEBUG
    tracker.min_refresh_period, tracker.max_refresh_period, tracker.default_refresh_period = 0.2, 1.0, 0.5
    tracker.expected_drift_peers, tracker.expected_drift_rate = 3, 0.2
    tracker.performance_ema = PerformanceEMA(alpha=0.1)
    tracker._local_public_key = key
    tracker.announced_epochs, tracker.downloading, tracker.ended = dict, dict, dict
    tracker.swarm_epochs = []  # what it hands the averager at each read (node.swarm.groupsize.BehindTheSwarm)
    tracker.on_swarm_epoch = tracker.swarm_epochs.append
    tracker.round_due, tracker.between_rounds_s, tracker._others_due_at, tracker._due_at = None, 3.0, None, None
    tracker._reads, tracker._read_wait, tracker._parsed = 0, (0, 0.0), (0, None)
    tracker._counted, tracker._missing = {}, (-1, frozenset())
    tracker.dht, tracker.client_mode = type("DHT", (), {"peer_id": PeerID(b"me")})(), client
    tracker.should_report_progress, tracker.global_state_updated = threading.Event(), threading.Event()
    tracker.lock_global_progress = threading.Lock()
    tracker.local_progress = LocalTrainingProgress(peer_id=b"me", epoch=local_epoch, samples_accumulated=8,
                                                   samples_per_second=1.0, time=get_dht_time(), client_mode=client)
    return tracker


def _entry(epoch: int, samples: int, client: bool = False, peer: bytes = b"p",
           rate: float = 1.0) -> ValueWithExpiration:
    progress = LocalTrainingProgress(peer_id=peer, epoch=epoch, samples_accumulated=samples, samples_per_second=rate,
                                     time=get_dht_time(), client_mode=client)
    return ValueWithExpiration(progress.dict(), get_dht_time() + 60)


def test_a_round_counts_only_peers_at_the_swarms_epoch():
    # this peer and a client at epoch 16; a peer that re-downloads the state still shows its record of epoch 14
    metadata = {b"me": _entry(16, 8), b"client": _entry(16, 4, client=True), b"behind": _entry(14, 40)}
    progress = _tracker(16)._parse_swarm_progress_data(metadata)
    assert (progress.epoch, progress.num_peers, progress.num_clients) == (16, 2, 1)
    assert progress.samples_accumulated == 12  # hivemind's rule, unchanged: samples of the epoch only
    # seen from the peer behind: the swarm is at 16, and it is in none of its rounds itself
    behind = _tracker(14, key=b"behind")
    progress = behind._parse_swarm_progress_data(metadata)
    assert (progress.epoch, progress.num_peers) == (16, 2)
    assert behind.swarm_epochs == [16]  # its averager ends a round still looking for a group at 14


def test_a_peer_announced_at_the_swarms_epoch_counts_whatever_its_record_says():
    # two full peers with no samples of their own joined two client rounds: hivemind no longer publishes their
    # progress, so their records still say epoch 2 while the swarm is at 3 with a client that gathered samples. This
    # peer counts by what it knows of itself, the other by its announcement; a peer that left after epoch 2 (its
    # record as idle as theirs) and a joiner that announced its download do not
    metadata = {b"me": _entry(2, 0, peer=b"me"), b"client": _entry(3, 4, client=True), b"idle": _entry(2, 0, peer=b"idle"),
                b"gone": _entry(2, 0, peer=b"gone"), b"joiner": _entry(1, 0, peer=b"joiner")}
    announced = {PeerID(b"idle").to_base58(): 3, PeerID(b"joiner").to_base58(): -1}
    tracker = _tracker(3)
    tracker.announced_epochs = lambda: announced
    progress = tracker._parse_swarm_progress_data(metadata)
    assert (progress.epoch, progress.num_peers, progress.num_clients) == (3, 3, 1)
    assert progress.samples_accumulated == 4
    # seen from the client: the two full peers at epoch 3 are in its round
    client = _tracker(3, key=b"client", client=True)
    client.announced_epochs = lambda: {**announced, PeerID(b"me").to_base58(): 3}
    progress = client._parse_swarm_progress_data(metadata)
    assert (progress.num_peers, progress.num_clients) == (3, 1)


def test_a_peer_that_announced_a_download_after_its_record_counts_by_neither():
    # b left at epoch 6 and this peer's rounds since then found no group (they looked for b): b's old record is at
    # the swarm's epoch. b is back with its identity and downloads the state; its announcement says so, later than
    # that record
    tracker = _tracker(6)
    tracker.round_due, tracker.others_present, tracker.settle_s = (lambda: True), (lambda: True), 60.0
    old = _entry(6, 8, peer=b"b", rate=0.0)
    metadata = {b"me": _entry(6, 8, peer=b"me"), b"b": old}
    downloading = {}
    tracker.downloading = lambda: downloading
    assert tracker._parse_swarm_progress_data(metadata).num_peers == 2
    downloading[PeerID(b"b").to_base58()] = old.value["time"] + 1.0
    assert tracker._parse_swarm_progress_data(metadata).num_peers == 1
    tracker.announced_epochs = lambda: {PeerID(b"b").to_base58(): 6}  # nor by an announcement of its epoch
    assert tracker._parse_swarm_progress_data(metadata).num_peers == 1
    # one epoch behind and due by that record: not late either
    tracker.local_progress = tracker._get_local_progress(7, 8)
    assert tracker._parse_swarm_progress_data({b"me": _entry(7, 8, peer=b"me"), b"b": old}).num_peers == 1
    # its download done, its record of the epoch it arrived in is the newer word: it counts
    metadata[b"b"] = arrived = _entry(7, 0, peer=b"b")
    arrived.value["time"] = downloading[PeerID(b"b").to_base58()] + 1.0
    metadata[b"me"] = _entry(7, 8, peer=b"me")
    assert tracker._parse_swarm_progress_data(metadata).num_peers == 2


def test_a_peer_whose_process_ended_after_its_record_counts_by_neither_until_it_writes_a_newer_one():
    # b's process ended right after the round of epoch 6: its record and its announcement still say epoch 6, due
    tracker = _tracker(6)
    b = PeerID(b"b").to_base58()
    last = _entry(6, 8, peer=b"b", rate=0.0)
    metadata = {b"me": _entry(6, 8, peer=b"me"), b"b": last}
    ended = {}
    tracker.ended, tracker.announced_epochs = (lambda: ended), (lambda: {b: 6})
    assert tracker._parse_swarm_progress_data(metadata).num_peers == 2
    ended[b] = last.value["time"] - 1.0  # found ended before it wrote this record: a restart since
    assert tracker._parse_swarm_progress_data(metadata).num_peers == 2
    ended[b] = last.value["time"] + 1.0  # this node's contact thread found its dial refused
    progress = tracker._parse_swarm_progress_data(metadata)
    assert progress.num_peers == 1 and tracker._others_due_at is None  # this peer alone: its next round updates
    # nor late, one epoch behind
    tracker.local_progress = tracker._get_local_progress(7, 8)
    assert tracker._parse_swarm_progress_data({b"me": _entry(7, 8, peer=b"me"), b"b": last}).num_peers == 1
    # back with the same identity, at the swarm's epoch: its record is newer than the refusal
    back = _entry(7, 0, peer=b"b")
    back.value["time"] = ended[b] + 1.0
    assert tracker._parse_swarm_progress_data({b"me": _entry(7, 8, peer=b"me"), b"b": back}).num_peers == 2


def test_no_records_is_hiveminds_own_answer():
    assert _tracker(3)._parse_swarm_progress_data({}).num_peers == 0


def test_a_low_comm_node_reads_the_swarms_progress_slowly_between_rounds_and_at_once_when_its_round_is_due():
    metadata = {b"me": _entry(4, 8, peer=b"me"), b"other": _entry(4, 8, peer=b"other")}
    tracker = _tracker(4)
    due = False
    tracker.round_due = lambda: due
    now = get_dht_time()
    assert tracker._parse_swarm_progress_data(metadata).next_fetch_time >= now + 3.0  # between rounds
    due = True
    assert tracker._parse_swarm_progress_data(metadata).next_fetch_time <= get_dht_time() + 1.0  # hivemind's pace
    due = False
    tracker.global_progress = tracker._parse_swarm_progress_data(metadata)
    due = True
    tracker.round_is_due()  # the fetcher, woken, finds no time left to wait, and the record says so
    assert tracker.global_state_updated.is_set() and tracker.global_progress.next_fetch_time <= get_dht_time()
    assert tracker.should_report_progress.is_set() and tracker.local_progress.samples_per_second == 0.0
    tracker.round_due = None  # per-step and the adapter: hivemind's pace throughout
    assert tracker._parse_swarm_progress_data(metadata).next_fetch_time <= get_dht_time() + 1.0


def test_a_round_begins_without_the_settle_wait_once_every_other_peer_says_its_round_is_due():
    tracker = _tracker(4)
    tracker.round_due, tracker.others_present, tracker.settle_s = (lambda: True), (lambda: True), 60.0
    # this peer's record says its round is due in its epoch: a rate of 0, which hivemind's estimate never is; the
    # record of the next epoch (hivemind writes it inside the update) says nothing of that epoch's round
    assert tracker._get_local_progress(4, 8).samples_per_second > 0.0
    tracker.global_progress = tracker._parse_swarm_progress_data({b"me": _entry(4, 8, peer=b"me")})
    tracker.round_is_due()
    assert tracker._get_local_progress(4, 8).samples_per_second == 0.0
    assert tracker._get_local_progress(5, 0).samples_per_second > 0.0

    def ready(metadata) -> bool:
        tracker.global_progress = tracker._parse_swarm_progress_data(metadata)
        tracker._seen_samples, tracker._grew_at = tracker.global_progress.samples_accumulated, time.monotonic()
        return tracker.ready_to_update_epoch

    me = _entry(4, 8, peer=b"me")
    assert ready({b"me": me, b"a": _entry(4, 8, peer=b"a", rate=0.0), b"b": _entry(4, 8, peer=b"b", rate=0.0)})
    # one peer still training: the settle rule decides (60 s here)
    assert not ready({b"me": me, b"a": _entry(4, 8, peer=b"a", rate=0.0), b"b": _entry(4, 8, peer=b"b")})
    # a due record of an older epoch (a peer that only joins clients' rounds, announced at 4) says nothing of this one
    tracker.announced_epochs = lambda: {PeerID(b"old").to_base58(): 4}
    assert not ready({b"me": me, b"a": _entry(4, 8, peer=b"a", rate=0.0), b"old": _entry(3, 0, peer=b"old", rate=0.0)})
    # what a read said of epoch 4 says nothing once this peer is at epoch 5
    assert ready({b"me": me, b"a": _entry(4, 8, peer=b"a", rate=0.0)})
    tracker.local_progress = tracker._get_local_progress(5, 0)
    tracker.global_progress.epoch = 5
    assert not tracker.ready_to_update_epoch and tracker.local_progress.samples_per_second > 0.0


def test_after_a_round_that_gave_no_update_the_next_waits_for_a_fresh_read_of_the_swarms_progress():
    # the read from before the round shows every peer due at epoch 4; meanwhile a peer made its update 5 alone
    tracker = _tracker(4)
    tracker.round_due, tracker.others_present, tracker.settle_s = (lambda: True), (lambda: True), 60.0
    tracker._seen_samples, tracker._grew_at = 0, time.monotonic()
    before = {b"me": _entry(4, 8, peer=b"me"), b"a": _entry(4, 8, peer=b"a", rate=0.0)}
    tracker.global_progress = tracker._parse_swarm_progress_data(before)
    assert tracker.ready_to_update_epoch
    tracker.read_before_next_round()
    assert tracker.global_state_updated.is_set()  # the read comes now
    assert not tracker.ready_to_update_epoch, "a round began on the read from before the last one"
    # the fresh read shows the swarm ahead: this peer catches up (hivemind's "ready" for a peer behind)
    tracker.global_progress = tracker._parse_swarm_progress_data({**before, b"a": _entry(5, 0, peer=b"a")})
    assert tracker.global_epoch == 5 and tracker.ready_to_update_epoch
    # or it shows the swarm where it was: the round begins as before
    tracker.read_before_next_round()
    tracker.global_progress = tracker._parse_swarm_progress_data(before)
    assert tracker.ready_to_update_epoch
    # a read already on its way when the round ended (it holds the progress lock) may show the swarm from before:
    # the round waits for the one after it
    with tracker.lock_global_progress:
        tracker.read_before_next_round()
        stale = tracker._parse_swarm_progress_data(before)
    tracker.global_progress = stale
    assert not tracker.ready_to_update_epoch, "a round began on a read that was on its way before the last round ended"
    tracker.global_progress = tracker._parse_swarm_progress_data(before)
    assert tracker.ready_to_update_epoch
    # and a read that never comes holds no round for longer than READ_WAIT_S
    tracker.read_before_next_round()
    tracker._read_wait = (tracker._read_wait[0], time.monotonic() - 1.0)
    assert tracker.ready_to_update_epoch


def test_a_node_whose_state_just_came_reads_the_swarms_progress_by_a_read_that_began_after_it():
    # the read from before a replay: the swarm at epoch 5 with no samples yet, this node still at 4 and not counted
    tracker = _tracker(4)
    tracker.global_progress = tracker._parse_swarm_progress_data({b"a": _entry(5, 0, peer=b"a")})
    assert tracker.global_progress.num_peers == 1 and tracker.others_counted(5) == 1
    tracker.local_progress = tracker.local_progress.copy(update=dict(epoch=5, samples_accumulated=0))  # replayed
    tracker.read_before_next_round()
    assert tracker.fresh_progress(0.2) is None  # the read asked for has not come
    after = {b"me": _entry(5, 0, peer=b"me"), b"a": _entry(5, 12, peer=b"a")}
    threading.Timer(0.3, lambda: setattr(tracker, "global_progress",
                                         tracker._parse_swarm_progress_data(after))).start()
    progress = tracker.fresh_progress(5.0)
    assert progress is not None and (progress.epoch, progress.samples_accumulated, progress.num_peers) == (5, 12, 2)
    assert tracker.fresh_progress(0.0) is progress  # nothing asked since: the last read is fresh
    # a read that does not hold this node's record at its new epoch yet counts it out of num_peers, not the others
    alone_looking = tracker._parse_swarm_progress_data({b"a": _entry(5, 20, peer=b"a")})
    assert alone_looking.num_peers == 1 and tracker.others_counted(5) == 1


def test_a_peer_one_epoch_behind_whose_round_is_due_counts_until_a_round_that_counted_it_went_without_it():
    # the swarm is at 5: b and this peer made the round of epoch 4 without c, which came late to its group; c's
    # record of epoch 4 says its round is due. It catches up by replay and brings its gradient to this round
    tracker = _tracker(5)
    tracker.round_due, tracker.others_present, tracker.settle_s = (lambda: True), (lambda: True), 60.0
    me, b = _entry(5, 8, peer=b"me"), _entry(5, 8, peer=b"b", rate=0.0)

    def read(metadata):
        tracker.global_progress = tracker._parse_swarm_progress_data(metadata)
        tracker._seen_samples, tracker._grew_at = tracker.global_progress.samples_accumulated, time.monotonic()
        return tracker.global_progress.num_peers, tracker.ready_to_update_epoch

    assert read({b"me": me, b"b": b, b"c": _entry(4, 8, peer=b"c", rate=0.0)}) == (3, True)  # due: no settle wait
    # one epoch behind and still training, or two behind: in no round of this epoch
    assert read({b"me": me, b"b": b, b"c": _entry(4, 8, peer=b"c")}) == (2, True)
    assert read({b"me": me, b"b": b, b"c": _entry(3, 8, peer=b"c", rate=0.0)}) == (2, True)
    # the round of epoch 5 counted c and went without it (it left while its round was due): at epoch 6 its record of
    # epoch 5 no longer counts, while d, behind when that round was counted, counts as c did above
    read({b"me": me, b"b": b, b"c": _entry(5, 8, peer=b"c", rate=0.0)})
    tracker.round_went(5, [PeerID(b"me").to_base58(), PeerID(b"b").to_base58()])
    tracker.local_progress = tracker._get_local_progress(6, 8)
    me, b = _entry(6, 8, peer=b"me"), _entry(6, 8, peer=b"b", rate=0.0)
    assert read({b"me": me, b"b": b, b"c": _entry(5, 8, peer=b"c", rate=0.0)}) == (2, True)
    assert read({b"me": me, b"b": b, b"c": _entry(5, 8, peer=b"c", rate=0.0),
                 b"d": _entry(5, 8, peer=b"d", rate=0.0)}) == (3, True)


@pytest.mark.slow
def test_a_joiner_reads_the_swarms_progress_at_once_not_at_the_pace_between_rounds():
    """A joiner decides how to take the state by the swarm's epoch, read by the tracker's fetcher (a real DHT and
    tracker thread here). The tracker's first read, made as it starts, is not a fetch, and left to the pace between
    rounds the fetcher's first comes that long after it: the joiner asks for it at once (`read_now`)."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    tracker = PacedTracker(dht=dht, prefix=f"join-{time.monotonic_ns()}", target_batch_size=1, settle_s=1.0,
                           round_due=lambda: False, between_rounds_s=30.0, start=True)
    try:
        assert not tracker.fetched_global_progress_this_epoch.wait(0.5)  # at the pace between rounds: not yet
        asked = time.monotonic()
        tracker.read_now()
        assert tracker.fetched_global_progress_this_epoch.wait(5.0), "the read asked for did not come"
        assert time.monotonic() - asked < 2.0
    finally:
        tracker.shutdown()
        dht.shutdown()
