"""The dial-back check against a real peer on 127.0.0.1: a node that can be dialed back, one whose announced
address leads nowhere (a home router that forwards nothing), and a helper that is gone."""
from __future__ import annotations

import hivemind
import pytest

from dtrain.node.swarm import reachability as r
from tests.nodeproc import free_port

pytestmark = pytest.mark.swarm

PEER = "12D3KooWJYreCjkJy6x63CrGGyskQLvStFRQoVp1X5e9yG7LB1E3"


@pytest.mark.timeout(120)
def test_a_peer_dials_back_the_announced_address_or_says_it_cannot():
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    service = r.ReachabilityService(dht)
    try:
        peers = [str(m) for m in dht.get_visible_maddrs()]
        ok = r.check_reachability(peers, ["/ip4/127.0.0.1/tcp/0"], [])
        assert (ok.verdict, ok.asked, ok.answered, ok.dialed) == ("reachable", 1, 1, 1)
        # announcing a port nothing listens on (a home router that forwards nothing): the helper's dial fails
        bad = r.check_reachability(peers, ["/ip4/127.0.0.1/tcp/0"], [f"/ip4/127.0.0.1/tcp/{free_port()}"])
        assert (bad.verdict, bad.answered, bad.dialed) == ("unreachable", 1, 0)
        # a helper that is gone: nothing learned
        gone = r.check_reachability([f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{PEER}"], ["/ip4/127.0.0.1/tcp/0"], [])
        assert (gone.verdict, gone.answered) == ("unchecked", 0)
    finally:
        service.shutdown()
        dht.shutdown()
