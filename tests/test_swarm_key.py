"""Closed swarms and signed records on real hivemind peers on 127.0.0.1 (node.swarm.swarmkey, node.swarm.records).

Peers holding the swarm key find each other's records; a peer without the key, or with another key, cannot join,
and the keyed peers refuse its requests even when it calls them directly. Inside the swarm, no peer can write a
record under another peer's subkey, whether it asks an honest peer to store it or serves it itself.
"""
from __future__ import annotations

import contextlib
import time
from functools import partial
from typing import Optional

import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from dtrain.node.config import ModelConfig, SwarmConfig, TrainConfig
from dtrain.node.model import build_model
from dtrain.node.swarm import swarm as swarm_optimizer
from dtrain.node.train.adamw import make_local_optimizer
from dtrain.node.swarm.presence import Presence, presence_key, presence_validator
from dtrain.node.swarm.records import RecordOwner, identity_kwargs, read, store
from dtrain.node.swarm.swarmkey import SwarmJoinError, SwarmKeyAuthorizer, keyed_run_id
from tests.nodeproc import PER_STEP, TINY_CONFIG, NodeProcess, new_run_id, shown_on_failure, start_swarm
from tests.texts import shakespeare

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

KEY, OTHER_KEY = b"k" * 32, b"o" * 32
RUN = "closed"
RECORDS_KEY = f"dtrain_{RUN}_test_records"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
RPC_BOUND_S = 30.0  # hivemind bounds one RPC by its wait_timeout (3 s); this only keeps a broken test from hanging


def start_dht(key: Optional[bytes], owner: RecordOwner, initial_peers=(), signing: bool = True,
              **kwargs) -> hivemind.DHT:
    """A DHT as a node starts it: its identity is `owner`'s key, it signs and checks records (unless `signing` is
    off: a peer running modified code) and, with `key`, HMACs every request and response."""
    validators = [owner.validator, presence_validator(RUN)] if signing else []
    with identity_kwargs(owner) as identity:
        return hivemind.DHT(host_maddrs=LOCAL, initial_peers=list(initial_peers), record_validators=validators,
                            authorizer=SwarmKeyAuthorizer(key) if key else None, start=True, **identity, **kwargs)


@contextlib.contextmanager
def dhts():
    started = []

    def start(*args, **kwargs):
        dht = start_dht(*args, **kwargs)
        started.append(dht)
        return dht

    try:
        yield start
    finally:
        for dht in reversed(started):
            dht.shutdown()


@pytest.fixture(scope="module")
def closed_swarm():
    """Two peers holding KEY, each with its record stored under RECORDS_KEY."""
    with dhts() as start:
        owners = RecordOwner.generate(), RecordOwner.generate()
        a = start(KEY, owners[0])
        b = start(KEY, owners[1], initial_peers=a.get_visible_maddrs())
        assert store(a, RECORDS_KEY, owners[0], {"who": "a"}) and store(b, RECORDS_KEY, owners[1], {"who": "b"})
        yield (a, owners[0]), (b, owners[1]), start


async def _find(_dht, node, peer: PeerID, key: str):
    key_id = DHTID.generate(source=key)
    found = await node.protocol.call_find(peer, [key_id])
    return None if found is None else found[key_id][0] is not None


async def _store(_dht, node, peer: PeerID, key: str, subkey, value: bytes):
    store_ok = await node.protocol.call_store(peer, [DHTID.generate(source=key)], [value], get_dht_time() + 30,
                                              subkeys=[subkey])
    return None if store_ok is None else list(store_ok)


def direct_find(dht: hivemind.DHT, peer: PeerID, key: str) -> Optional[bool]:
    """Whether `peer` answered a find RPC sent straight to it with a value (None: refused, or no answer)."""
    return dht.run_coroutine(partial(_find, peer=peer, key=key), return_future=True).result(RPC_BOUND_S)


def direct_store(dht: hivemind.DHT, peer: PeerID, key: str, subkey, value: bytes):
    """`peer`'s store_ok for one value sent straight to it (None: refused or no answer)."""
    return dht.run_coroutine(partial(_store, peer=peer, key=key, subkey=subkey, value=value),
                             return_future=True).result(RPC_BOUND_S)


def test_peers_with_the_key_find_each_others_records(closed_swarm):
    (a, owner_a), (b, owner_b), _ = closed_swarm
    assert str(a.peer_id) == owner_a.peer_id and str(b.peer_id) == owner_b.peer_id  # subkeys name the real peers
    expected = {owner_a.peer_id: {"who": "a"}, owner_b.peer_id: {"who": "b"}}
    assert read(a, RECORDS_KEY) == expected and read(b, RECORDS_KEY) == expected
    assert direct_find(b, a.peer_id, RECORDS_KEY) is True  # the contrast for the refusals below


@pytest.mark.parametrize("outsider_key", [None, OTHER_KEY], ids=["keyless", "other-key"])
def test_a_peer_without_the_key_cannot_join(closed_swarm, outsider_key):
    (a, _), _, start = closed_swarm
    with pytest.raises(RuntimeError, match="bootstrap failed"):
        start(outsider_key, RecordOwner.generate(), initial_peers=a.get_visible_maddrs())


@pytest.mark.parametrize("outsider_key", [None, OTHER_KEY], ids=["keyless", "other-key"])
def test_a_peer_without_the_key_can_neither_read_nor_store(closed_swarm, outsider_key):
    (a, owner_a), (b, owner_b), start = closed_swarm
    outsider_owner = RecordOwner.generate()
    # it connects at the libp2p level (p2pd has no private network), but every DHT request of it is refused
    outsider = start(outsider_key, outsider_owner, initial_peers=a.get_visible_maddrs(),
                     ensure_bootstrap_success=False)
    assert direct_find(outsider, a.peer_id, RECORDS_KEY) is None
    value = MSGPackSerializer.dumps({"who": "outsider"})
    assert direct_store(outsider, a.peer_id, RECORDS_KEY, b"plain subkey", value) is None
    # through its own DHT it sees nobody's records, and nobody sees its own
    store(outsider, RECORDS_KEY, outsider_owner, {"who": "outsider"})
    assert read(outsider, RECORDS_KEY) == {outsider_owner.peer_id: {"who": "outsider"}}
    expected = {owner_a.peer_id: {"who": "a"}, owner_b.peer_id: {"who": "b"}}
    assert read(a, RECORDS_KEY) == expected and read(b, RECORDS_KEY) == expected


def test_a_peer_cannot_write_another_peers_record(closed_swarm):
    (a, owner_a), (b, owner_b), start = closed_swarm
    # an insider: it holds the key, but runs without the record checks and writes as it pleases
    forger_owner = RecordOwner.generate()
    forger = start(KEY, forger_owner, initial_peers=a.get_visible_maddrs(), signing=False)
    forged = MSGPackSerializer.dumps({"who": "forged"})
    # the contrast: honest peers take what it sends under a subkey that names no owner (readers skip such subkeys)
    assert direct_store(forger, a.peer_id, RECORDS_KEY, b"no owner", forged) == [True]
    # asked to store a value under a's subkey, unsigned or with a made-up signature, honest peers refuse it
    for value in (forged, forged + b"[signature:" + b"A" * 344 + b"]"):
        assert direct_store(forger, a.peer_id, RECORDS_KEY, owner_a.subkey, value) == [False]
        assert direct_store(forger, b.peer_id, RECORDS_KEY, owner_a.subkey, value) == [False]
    # the announcements' entry takes only signed subkeys: an unsigned one naming a by its peer id is refused too
    assert direct_store(forger, b.peer_id, presence_key(RUN), owner_a.peer_id, forged) == [False]
    # stored through its own DHT (which keeps it: it checks nothing), the forgery reaches no honest reader
    forger.store(RECORDS_KEY, {"who": "forged"}, get_dht_time() + 30, subkey=owner_a.subkey)
    forger.store(RECORDS_KEY, {"who": "forged"}, get_dht_time() + 30, subkey=owner_a.peer_id)
    expected = {owner_a.peer_id: {"who": "a"}, owner_b.peer_id: {"who": "b"}}
    for _ in range(3):  # every read asks the forger too (three peers, bucket size 20)
        assert read(a, RECORDS_KEY) == expected and read(b, RECORDS_KEY) == expected


def test_keyed_swarms_train_under_a_keyed_run_name_and_announce_signed_records(tmp_path):
    """Two node Swarms with one key: the run's DHT name is keyed, each one's tracker and presence see the other;
    a Swarm with another key cannot start beside them, and says why."""
    key_file, other_file = tmp_path / "swarm.key", tmp_path / "other.key"
    key_file.write_bytes(KEY)
    other_file.write_bytes(OTHER_KEY)
    run_id = new_run_id()

    def make(path, initial_peers=()):
        model = build_model(ModelConfig.load(TINY_CONFIG))
        config = SwarmConfig(host_maddrs=tuple(LOCAL), initial_peers=tuple(initial_peers), run_id=run_id,
                             swarm_key_path=str(path), target_batch_size=64, matchmaking_time_s=1.0,
                             request_timeout_s=0.5, averaging_timeout_s=2.0)
        return swarm_optimizer.Swarm(config, make_local_optimizer(model, TrainConfig()),
                                     local_gradients=lambda: [])

    swarms = []
    try:
        swarms.append(make(key_file))
        swarms.append(make(key_file, swarms[0].maddrs))
        a, b = swarms
        assert a.run_id == b.run_id == keyed_run_id(KEY, run_id) and a.optimizer.run_id == a.run_id
        presences = [Presence(s.dht, s.run_id, s.owner, s.maddrs, bridge_port=8000 + i) for i, s in enumerate(swarms)]
        for s in swarms:
            s.optimizer.tracker.report_local_progress(0, 3)
        deadline = time.monotonic() + 30
        while True:  # the trackers read the swarm's progress every second at most
            seen = {frozenset(p.refresh(step=0, pending_samples=3)) for p in presences}
            progress = [s.optimizer.tracker.global_progress for s in swarms]
            if seen == {frozenset((a.peer_id, b.peer_id))} and all(p.num_peers == 2 for p in progress):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert seen == {frozenset((a.peer_id, b.peer_id))}
        assert [s.optimizer.tracker.global_progress.num_peers for s in swarms] == [2, 2]
        assert [s.optimizer.tracker.global_progress.samples_accumulated for s in swarms] == [6, 6]
        with pytest.raises(SwarmJoinError, match="none of the initial peers answered with this --swarm-key"):
            make(other_file, a.maddrs)
    finally:
        for s in reversed(swarms):
            s.shutdown()


@pytest.mark.timeout(300)
def test_nodes_with_the_key_train_in_lockstep_and_a_node_with_another_key_stops(tmp_path):
    """Two dtrain-node processes with --swarm-key serve the same bytes after every update; a third one with another
    key exits with status 2 and says why, and one with none fails to join."""
    from tests.test_swarm import _check_lockstep, _train_args

    key_file, other_file, text = tmp_path / "swarm.key", tmp_path / "other.key", tmp_path / "train.txt"
    key_file.write_bytes(KEY)
    other_file.write_bytes(OTHER_KEY)
    text.write_text(shakespeare(30_000))
    run_id = new_run_id()
    nodes = start_swarm(2, _train_args(text, 2, ["--swarm-key", str(key_file)]), run_id)
    with shown_on_failure(nodes):
        maddrs = nodes[0].wait_ready()
        # the two outsiders try to join at the same time: each waits out its own bootstrap, which fails
        other = NodeProcess("other-key", [*PER_STEP, "--model-config", str(TINY_CONFIG), "--swarm-key", str(other_file)],
                            run_id, initial_peers=maddrs)
        nodes.append(other)
        keyless = NodeProcess("keyless", [*PER_STEP, "--model-config", str(TINY_CONFIG)], run_id, initial_peers=maddrs)
        nodes.append(keyless)
        assert other.proc.wait(120) == 2, other.output()[-3000:]
        assert "none of the initial peers answered with this --swarm-key" in other.output()
        assert keyless.proc.wait(120) != 0, keyless.output()[-3000:]
        assert "bootstrap failed" in keyless.output()
        assert [n.status()["closed"] for n in nodes[:2]] == [True, True]
        keyed = {n.status()["peer_id"] for n in nodes[:2]}
        _check_lockstep(nodes[:2], peers=2, epochs=2)
        for node in nodes[:2]:
            node.terminate()
        for node in nodes[:2]:  # each proved the key to the other's averagers (node.swarm.keygate); the nodes with
            # another key or none asked for a dial-back check and were refused
            refused = [line for line in node.output().splitlines() if "did not prove the swarm key" in line]
            assert not [line for line in refused if any(peer in line for peer in keyed)], refused
