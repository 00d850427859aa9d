"""The digest agreement between two real peers in one process (real DHT, real hivemind state downloads): a
peer whose parameters differ from the reference's after an update serves the reference's bytes, whether the
reference published before it compared or only later."""
from __future__ import annotations

import threading

import pytest
import torch

from node import swarm
from node.agreement import Agreement
from node.config import ModelConfig, SwarmConfig, TrainConfig
from node.model import build_model
from node.snapshot import make_snapshot, params_digest
from tests.nodeproc import TINY_CONFIG, new_run_id

EPOCH = 1  # the update both peers have just applied


class Peer:
    def __init__(self, run_id: str, initial_peers=(), priority: float = 0.5):
        self.model = build_model(ModelConfig.load(TINY_CONFIG))
        seed_digest = params_digest(self.model)
        self.config = SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=tuple(initial_peers),
                                  run_id=run_id, target_batch_size=64, matchmaking_time_s=1.0,
                                  request_timeout_s=0.5, averaging_timeout_s=2.0)
        self.dht = swarm.create_dht(self.config)
        self.opt = swarm.make_swarm_optimizer(self.dht, swarm.make_local_optimizer(self.model, TrainConfig()),
                                              self.config)
        # as after update EPOCH: the epoch, and the state-sharing priority SwarmOptimizer gives an updater
        self.opt.update_priority = priority
        self.opt.state_averager.local_epoch = EPOCH
        self.opt.state_averager.state_sharing_priority = EPOCH + priority
        self.opt.tracker.report_local_progress(EPOCH, 0)
        self.stop = threading.Event()
        self.agreement = Agreement(self.dht, self.opt, self.model, self.config, self.stop, seed_digest)

    def snapshot(self):
        return make_snapshot(self.model, self.opt.local_epoch)

    def shutdown(self):
        self.stop.set()
        swarm.shutdown(self.opt, self.dht)


@pytest.fixture
def peers():
    run_id = new_run_id()
    reference = Peer(run_id, priority=0.9)
    other = Peer(run_id, initial_peers=[str(a) for a in reference.dht.get_visible_maddrs()], priority=0.6)
    with torch.no_grad():  # an averaging round that failed for `other`: its parameters are its own
        next(other.model.parameters()).add_(1e-3)
    try:
        yield reference, other
    finally:
        other.shutdown()
        reference.shutdown()


def _records(peer):
    return swarm.list_digests(peer.dht, peer.config.run_id, EPOCH)


def test_peers_that_updated_together_serve_the_reference_bytes(peers):
    reference, other = peers
    ref_snap, other_snap = reference.snapshot(), other.snapshot()
    assert ref_snap.digest != other_snap.digest
    agreed = {}
    waiter = threading.Thread(target=lambda: agreed.update(ref=reference.agreement.after_update(ref_snap, 2)))
    waiter.start()
    agreed["other"] = other.agreement.after_update(other_snap, 2)
    waiter.join(30)
    assert agreed["ref"] is ref_snap  # the reference keeps its own parameters
    assert agreed["other"].digest == ref_snap.digest == params_digest(other.model)
    assert agreed["other"].updates == EPOCH
    # Adam's moments came with the parameters
    for p, q in zip(reference.model.parameters(), other.model.parameters()):
        ref_state = reference.opt.state_averager.optimizer.state[p]
        other_state = other.opt.state_averager.optimizer.state[q]
        assert torch.equal(ref_state["exp_avg_sq"], other_state["exp_avg_sq"])
    # what both published for the epoch is now one digest, each with its own priority
    records = _records(reference)
    assert {r["digest"] for r in records.values()} == {ref_snap.digest}
    assert sorted(r["priority"] for r in records.values()) == [EPOCH + 0.6, EPOCH + 0.9]


def test_a_reference_that_publishes_late_is_caught_before_the_next_update(peers):
    reference, other = peers
    other_snap = other.snapshot()
    # `other` thought it updated alone: it published and compared with nobody
    assert other.agreement.after_update(other_snap, 1) is other_snap
    assert other.agreement.recheck(other_snap, force=True) is other_snap  # nothing to compare with yet
    ref_snap = reference.snapshot()
    reference.agreement.after_update(ref_snap, 1)
    agreed = other.agreement.recheck(other_snap, force=True)
    assert agreed.digest == ref_snap.digest == params_digest(other.model)
    assert {r["digest"] for r in _records(other).values()} == {ref_snap.digest}


def test_a_failed_download_is_not_confirmed_by_the_own_record(peers):
    reference, other = peers
    other_snap = other.snapshot()
    other.agreement.vouch(other_snap)  # its own record of this epoch is in the DHT
    assert set(_records(other)) == {other.agreement.peer_id}
    reference.shutdown()  # the download finds no peer and leaves `other` with its own bytes
    assert other.agreement.load_state_from_peers() is False
    assert params_digest(other.model) == other_snap.digest
