"""Which peers a node remembers and when it is isolated from them (node.swarm.contact): `isolated` holds only while
two or more remembered peers are all silent."""
from __future__ import annotations

import pytest

from dtrain.node.swarm import contact as contact_module
from dtrain.node.swarm.contact import SILENT_AFTER_S, Contact, dialable
from dtrain.node.swarm.presence import PeerInfo

pytestmark = pytest.mark.unit


def test_isolated_only_while_two_or_more_remembered_peers_are_all_silent():
    now = [1000.0]
    view: dict[str, PeerInfo] = {}
    contact = Contact(None, "me", lambda: view, clock=lambda: now[0])  # isolated() reads no DHT

    def peer(name: str, at: float) -> PeerInfo:
        return PeerInfo(peer_id=name, step=1, bridge_port=0, maddrs=(f"/ip4/10.0.0.1/tcp/1/p2p/{name}",),
                        training=True, pending_samples=0, time=at)

    view.update(me=peer("me", 1000.0), b=peer("b", 1000.0))
    now[0] = 1000.0 + SILENT_AFTER_S + 1
    assert not contact.isolated()  # one remembered peer: a swarm of two, where nothing tells whose link went
    view["c"] = peer("c", 1000.0)
    assert contact.isolated()  # both silent
    assert set(contact.known) == {"b", "c"} and contact.known["b"].maddrs == ("/ip4/10.0.0.1/tcp/1",)
    view["c"] = peer("c", now[0] - 1)  # c announced itself again
    assert not contact.isolated()
    view.clear()  # the announcements expired: still remembered, as heard when they last announced
    now[0] += SILENT_AFTER_S + 1
    assert contact.isolated()
    now[0] += contact_module.REMEMBER_S
    contact.reach_all()  # forgets the peers not heard from for REMEMBER_S (nothing left to ping)
    assert contact.known == {} and not contact.isolated()


def test_dialable_drops_the_peer_id():
    assert dialable(["/ip4/1.2.3.4/tcp/5/p2p/Qm", "/ip4/1.2.3.4/udp/5/quic/p2p/Qm"]) == (
        "/ip4/1.2.3.4/tcp/5", "/ip4/1.2.3.4/udp/5/quic")
