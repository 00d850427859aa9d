"""Reaching the peers a node trained with (node.swarm.contact), between real DHT peers on 127.0.0.1: a ping puts a
peer that knew nobody back in the routing table, and a peer whose process ended is refused and forgotten, at once
after a failed round (`reach_now`) however lately it announced itself."""
from __future__ import annotations

import time

import hivemind
from hivemind.utils import get_dht_time
import pytest

from dtrain.node.swarm.contact import ANSWERED, QUIET_AFTER_S, REACH_EVERY_S, REFUSED, Contact
from dtrain.node.swarm.others import Others
from dtrain.node.swarm.presence import PeerInfo

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def announced(dht: hivemind.DHT, at: float) -> PeerInfo:
    """What `dht`'s node would have announced at `at` (its peer id and addresses are real)."""
    peer = str(dht.peer_id)
    return PeerInfo(peer_id=peer, step=1, bridge_port=0, maddrs=tuple(str(m) for m in dht.get_visible_maddrs()),
                    training=True, pending_samples=0, time=at, epoch=1)


def started(count: int, connected: bool = True) -> list[hivemind.DHT]:
    dhts = [hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)]
    for _ in range(count - 1):
        peers = dhts[0].get_visible_maddrs() if connected else []
        dhts.append(hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers, start=True))
    return dhts


def test_a_ping_puts_a_peer_back_in_the_routing_table_and_an_ended_peer_is_forgotten():
    a, b, c = dhts = started(3, connected=False)  # three DHTs that know nobody: a split swarm
    try:
        b.store("held-by-b", "value", get_dht_time() + 60)
        assert a.get("held-by-b", latest=True) is None  # a reaches nobody
        contact = Contact(a, str(a.peer_id), lambda: {str(d.peer_id): announced(d, get_dht_time()) for d in (b, c)})
        assert contact.reach_all() == {}  # both announced themselves just now: no ping
        quiet = get_dht_time() - QUIET_AFTER_S - 1
        contact = Contact(a, str(a.peer_id), lambda: {str(d.peer_id): announced(d, quiet) for d in (b, c)})
        assert contact.reach_all() == {str(b.peer_id): ANSWERED, str(c.peer_id): ANSWERED}
        found = a.get("held-by-b", latest=True)
        assert found is not None and found.value == "value"  # b is in a's routing table again
        assert not contact.isolated()

        gone = str(c.peer_id)
        last_word = announced(c, get_dht_time())
        c.shutdown()  # its p2pd ends: the port is closed, a dial is refused (once libp2p's dial backoff allows one)
        # its announcement is still fresh (a record outlives its process): the thread's pings wait until it is quiet,
        # a failed round's reach_now pings at once
        contact._announced = lambda: {str(b.peer_id): announced(b, get_dht_time()), gone: last_word}
        assert contact.reach_all() == {}
        outcomes = []
        deadline = time.monotonic() + 60
        while gone in contact.known and time.monotonic() < deadline:
            outcomes.append(contact.reach_now().get(gone))
            time.sleep(1.0)
        assert gone not in contact.known and outcomes[-1] == REFUSED, outcomes
        assert contact.ended()[gone] - last_word.time < QUIET_AFTER_S  # before the thread's own ping would have come
        assert str(b.peer_id) in contact.known
        assert list(contact.ended()) == [gone] and 0 <= get_dht_time() - contact.ended()[gone] < 5
        others = Others()  # as the node's optimizer and tracker read it
        others.contact = contact
        assert others.ended() == contact.ended() and not others.isolated()
        assert gone not in contact.known  # its announcement, read again, does not bring it back
        # a peer quiet for longer is the thread's to ping: a failed round's reach_now waits for no dial of it (an
        # isolated node's rounds all fail, and its training thread would wait on dials that time out)
        contact._announced = lambda: {str(b.peer_id): announced(b, quiet)}
        contact.known[str(b.peer_id)].heard = quiet
        time.sleep(REACH_EVERY_S)
        assert contact.reach_now() == {}
        assert contact.reach_all() == {str(b.peer_id): ANSWERED}
    finally:
        for d in dhts:
            d.shutdown()
