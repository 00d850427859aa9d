"""The agreement between two real peers in one process (real DHT, real hivemind state downloads): after an update
every peer serves the reference's bytes, a served record outranks a later one, and each peer knows whether its own
gradient is in the bytes it serves."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from dtrain.node.swarm import agreement as agreement_module
from dtrain.node.swarm import records as dht_records
from dtrain.node.swarm import swarm
from dtrain.node.train.adamw import make_local_optimizer
from dtrain.node.swarm.agreement import KEEP_EPOCHS, Agreement, Download
from dtrain.node.swarm.presence import Presence
from dtrain.node.config import ModelConfig, SwarmConfig, TrainConfig
from dtrain.node.model import build_model
from dtrain.node.snapshot import make_snapshot, params_digest
from dtrain.node.swarm.optimizer import RoundOutcome
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until

pytestmark = pytest.mark.swarm

EPOCH = 1  # the update both peers have just applied


class Peer:
    def __init__(self, run_id: str, initial_peers=(), bonus: float = 0.8, epoch: int = EPOCH):
        self.model = build_model(ModelConfig.load(TINY_CONFIG))
        seed_digest = params_digest(self.model)
        self.config = SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=tuple(initial_peers),
                                  run_id=run_id, target_batch_size=64, matchmaking_time_s=1.0,
                                  request_timeout_s=0.5, averaging_timeout_s=2.0)
        self.swarm = swarm.Swarm(self.config, make_local_optimizer(self.model, TrainConfig()),
                                 local_gradients=lambda: [])
        self.opt, self.peer_id = self.swarm.optimizer, self.swarm.peer_id
        # as after update `epoch`: the epoch, and the state-sharing priority an updater has
        self.opt.state_averager.local_epoch = epoch
        self.opt.state_averager.state_sharing_priority = epoch + bonus
        self.opt.tracker.report_local_progress(epoch, 0)
        self.stop = threading.Event()
        # announced by nobody (no Presence.refresh here): a peer counts as alive while it is connected
        self.presence = Presence(self.swarm.dht, self.swarm.run_id, self.swarm.owner, self.swarm.maddrs, 0)
        self.agreement = Agreement(self.swarm.dht, self.opt, self.model, self.config, self.stop, seed_digest,
                                   self.swarm.owner, present=lambda: self.presence.alive(self.swarm.service))

    def snapshot(self):
        return make_snapshot(self.model, self.opt.local_epoch)

    def shutdown(self):
        self.stop.set()
        self.swarm.shutdown()


@pytest.fixture
def peers():
    run_id = new_run_id()
    reference = Peer(run_id, bonus=0.9)
    other = Peer(run_id, initial_peers=reference.swarm.maddrs, bonus=0.75)
    with torch.no_grad():  # rounding left `other` with parameters of its own
        next(other.model.parameters()).add_(1e-3)
    try:
        yield reference, other
    finally:
        other.shutdown()
        reference.shutdown()


def test_peers_of_one_round_serve_the_reference_bytes_with_both_gradients(peers):
    reference, other = peers
    group = tuple(sorted((reference.peer_id, other.peer_id)))
    ref_snap, other_snap = reference.snapshot(), other.snapshot()
    assert ref_snap.digest != other_snap.digest
    verdicts = {}
    waiter = threading.Thread(target=lambda: verdicts.update(
        ref=reference.agreement.after_update(ref_snap, RoundOutcome(EPOCH, group, clean=True))))
    waiter.start()
    verdicts["other"] = other.agreement.after_update(other_snap, RoundOutcome(EPOCH, group, clean=True))
    waiter.join(30)
    assert verdicts["ref"].snapshot is ref_snap  # the reference keeps its own parameters
    assert verdicts["other"].snapshot.digest == ref_snap.digest == params_digest(other.model)
    assert verdicts["other"].snapshot.updates == EPOCH
    assert verdicts["ref"].included and verdicts["other"].included  # one round: both gradients are in it
    for p, q in zip(reference.model.parameters(), other.model.parameters()):  # Adam's moments came along
        ref_state = reference.opt.state_averager.optimizer.state[p]
        other_state = other.opt.state_averager.optimizer.state[q]
        assert torch.equal(ref_state["exp_avg_sq"], other_state["exp_avg_sq"])
    records = reference.agreement.records(EPOCH)
    assert {r.digest for r in records.values()} == {ref_snap.digest}
    assert all(r.served for r in records.values())


def test_a_member_that_died_after_the_round_is_not_waited_for_and_a_live_silent_one_is(peers):
    """A member that dies right after a complete round publishes no record: its group waited the whole group wait
    for it. A member neither announced nor connected is waited for no longer; one still connected (a live node whose
    update is slow) is waited for as before."""
    reference, other = peers
    dead = Peer(reference.swarm.run_id, initial_peers=reference.swarm.maddrs)
    dead_id = dead.peer_id
    wait_until(lambda: dead_id in reference.presence.alive(reference.swarm.service), 30, "the dead peer's connection")
    dead.shutdown()
    snap = reference.snapshot()
    began = time.monotonic()
    verdict = reference.agreement.after_update(snap, RoundOutcome(EPOCH, (reference.peer_id, dead_id), clean=True))
    took = time.monotonic() - began
    assert verdict.snapshot is snap and verdict.included
    assert took < reference.agreement.group_wait_s - 1.0, (took, reference.agreement.group_wait_s)

    # `other` is connected and publishes nothing for the next epoch: waited for until the group wait ends
    reference.opt.state_averager.local_epoch = EPOCH + 1
    began = time.monotonic()
    later = reference.snapshot()
    verdict = reference.agreement.after_update(later, RoundOutcome(EPOCH + 1, (reference.peer_id, other.peer_id),
                                                                   clean=True))
    assert time.monotonic() - began >= reference.agreement.group_wait_s and verdict.snapshot is later


def test_a_served_update_outranks_a_later_one_which_carries_its_gradient(peers):
    reference, other = peers
    other_snap = other.snapshot()
    # `other`'s gradient round failed: it updated with its own gradient, and serves it (it waits for nobody)
    failed = RoundOutcome(EPOCH, (other.peer_id,), clean=False)
    verdict = other.agreement.after_update(other_snap, failed)
    assert verdict.snapshot is other_snap and verdict.included
    # the higher-priority peer publishes later, from a round without `other`: it follows the served bytes
    alone = RoundOutcome(EPOCH, (reference.peer_id,), clean=True)
    verdict = reference.agreement.after_update(reference.snapshot(), alone)
    assert verdict.snapshot.digest == other_snap.digest == params_digest(reference.model)
    assert verdict.reference == other.peer_id
    assert not verdict.included  # its gradient is not in `other`'s update: the node carries it
    assert other.agreement.recheck(other_snap, force=True) is other_snap


def test_a_peers_records_outlive_their_ttl_while_its_training_thread_is_busy(monkeypatch):
    """A peer's records stay readable however long its training thread does not come back (a minute-long outer
    round of GPT-2 small on 2 cores): they are refreshed on a thread of their own. Refreshed between iterations of
    the training thread, they lapsed inside every such round, and a joiner found no record to check its download
    against."""
    monkeypatch.setattr(dht_records, "RECORD_TTL_S", 2.0)
    monkeypatch.setattr(agreement_module, "KEEP_ALIVE_S", 0.5)
    run_id = new_run_id()
    publisher = Peer(run_id)
    reader = Peer(run_id, initial_peers=publisher.swarm.maddrs)
    try:
        publisher.agreement.vouch(publisher.snapshot())  # and nothing more from its training thread
        time.sleep(3 * dht_records.RECORD_TTL_S)
        assert set(reader.agreement.records(EPOCH)) == {publisher.peer_id}
        publisher.stop.set()  # the node stops: its records lapse
        wait_until(lambda: not reader.agreement.records(EPOCH), 10, "the stopped peer's records to expire")
    finally:
        reader.shutdown()
        publisher.shutdown()


def test_a_failed_download_is_not_confirmed_by_the_own_record(peers):
    reference, other = peers
    other_snap = other.snapshot()
    other.agreement.vouch(other_snap)  # its own record of this epoch is in the DHT
    assert set(other.agreement.records(EPOCH)) == {other.agreement.peer_id}
    reference.shutdown()  # the download finds no peer and leaves `other` with its own bytes
    assert other.agreement.load_state_from_peers() is Download.UNCHECKED  # nobody else published: unconfirmed
    assert params_digest(other.model) == other_snap.digest


def test_the_wait_for_a_downloads_records_ends_once_the_swarm_is_seen_past_their_keeping(peers):
    """A download labelled with an epoch nobody published is kept unchecked. Its wait for the records ends when the
    swarm is seen KEEP_EPOCHS past that epoch (the peers keep no records that old), not at the wait's deadline: a
    joiner over a slow link, whose view of the swarm was held up by its own download, waited out the whole deadline
    for records that were gone."""
    reference, other = peers
    reference.shutdown()  # the download finds no peer and leaves `other` with bytes of EPOCH nobody published
    seen = threading.Timer(1.0, other.agreement.saw, args=(EPOCH + KEEP_EPOCHS,))  # the tracker catches up
    seen.start()
    started = time.monotonic()
    try:
        assert other.agreement.load_state_from_peers() is Download.UNCHECKED
        assert time.monotonic() - started < other.agreement.wait_s
    finally:
        seen.cancel()


def test_a_joiner_that_saw_the_swarm_ahead_never_takes_the_seeded_model_for_its_state():
    """The tracker's view of the swarm is its peers' progress records, which expire: a swarm test's joiner, whose
    only peer's DHT had stopped answering, saw the tracker fall from epoch 4 to 0 a minute later, took the seeded
    model for the swarm's state, and served its own step 2 next to the peer's. A joiner that saw the swarm at a later
    epoch keeps refusing the seeded model, whatever the tracker shows then."""
    joiner = Peer(new_run_id(), epoch=0)  # alone in its swarm: no peer shares a state, the tracker shows epoch 0
    try:
        assert joiner.opt.tracker.global_epoch == 0
        seeded = params_digest(joiner.model)
        assert joiner.agreement.load_state_from_peers() is Download.CHECKED  # a swarm at epoch 0: the seed is it
        assert joiner.agreement.saw(3) == 3 and joiner.agreement.saw(0) == 3  # what the join saw, never undone
        assert joiner.agreement.load_state_from_peers() is Download.REFUSED
        assert joiner.opt.tracker.global_epoch == 0 and params_digest(joiner.model) == seeded
    finally:
        joiner.shutdown()


def test_a_joiner_holds_the_swarm_start_only_with_its_bytes_and_hyperparameters():
    """At epoch 0 a joiner's own state is the swarm's when the peers' record of epoch 0 has its parameters' digest and
    its optimizer's hyperparameters (a download would carry them): it then takes no download. No record within the
    bound, another seed, or another learning rate: it downloads."""
    run_id = new_run_id()
    founder = Peer(run_id, epoch=0)
    joiner = Peer(run_id, initial_peers=founder.swarm.maddrs, epoch=0)
    try:
        seeded = params_digest(joiner.model)
        assert seeded == params_digest(founder.model)  # one config, one seed: the same start
        assert not joiner.agreement.holds_swarm_start(seeded, wait_s=1.0)  # nobody published epoch 0 yet
        founder.agreement.vouch(founder.snapshot())  # as a founder does when it starts
        assert joiner.agreement.holds_swarm_start(seeded, wait_s=10.0)
        group = joiner.opt.state_averager.optimizer.param_groups[0]
        lr = group["lr"]
        group["lr"] = 2 * lr
        assert not joiner.agreement.holds_swarm_start(seeded, wait_s=10.0)
        group["lr"] = lr
        with torch.no_grad():  # another seed's weights
            next(joiner.model.parameters()).add_(1e-3)
        assert not joiner.agreement.holds_swarm_start(params_digest(joiner.model), wait_s=10.0)
        assert joiner.agreement.holds_swarm_start(seeded, wait_s=10.0)  # the same record, the start's bytes
    finally:
        joiner.shutdown()
        founder.shutdown()


def test_a_recheck_between_updates_waits_for_no_read(peers, monkeypatch):
    """Between updates the training thread rechecks on the last read made on a thread of its own: it returns at
    once while that read is held up (as behind an uplink a state download fills); forced, right before an update,
    it reads now."""
    from dtrain.node.swarm import records as dht_records
    reference, other = peers
    other_snap = other.snapshot()
    other.agreement.after_update(other_snap, RoundOutcome(EPOCH, (other.peer_id,), clean=False))
    released, reads = threading.Event(), []
    real_lookup = dht_records.lookup

    def held_lookup(dht, key, timeout_s=dht_records.TIMEOUT_S):
        reads.append(key)
        released.wait(30)
        return real_lookup(dht, key, timeout_s)

    monkeypatch.setattr(dht_records, "lookup", held_lookup)
    try:
        started = time.monotonic()
        assert other.agreement.recheck(other_snap) is other_snap
        assert time.monotonic() - started < 0.5 and len(reads) == 1  # one read started, none waited for
        assert other.agreement.recheck(other_snap) is other_snap and len(reads) == 1  # still one at a time
    finally:
        released.set()
    assert other.agreement.recheck(other_snap, force=True) is other_snap and len(reads) == 2
