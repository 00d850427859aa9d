"""The dial-back check's pure parts: its request codec refuses what it must, its verdict, the flag's choice, and
client-mode records in the agreement. Real checks on 127.0.0.1 are in test_reachability_dial.py."""
from __future__ import annotations

import json

import pytest

from dtrain.node.swarm import reachability as r
from dtrain.node.swarm.agreement import Record, reference_of

pytestmark = pytest.mark.unit

PEER = "12D3KooWJYreCjkJy6x63CrGGyskQLvStFRQoVp1X5e9yG7LB1E3"


def test_request_round_trip_drops_relayed_addresses_and_the_peer_suffix():
    request = r.encode_request(PEER, [f"/ip4/10.0.0.1/tcp/4100/p2p/{PEER}", f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}/p2p-circuit",
                                      "/ip4/127.0.0.1/tcp/4100"])
    peer, maddrs = r.decode_request(request.value)
    assert str(peer) == PEER
    assert [str(m) for m in maddrs] == ["/ip4/10.0.0.1/tcp/4100", "/ip4/127.0.0.1/tcp/4100"]


@pytest.mark.parametrize("raw, error", [
    ("not json", "not JSON"),
    (json.dumps([1]), "must be"),
    (json.dumps({"peer_id": "nope", "maddrs": ["/ip4/1.2.3.4/tcp/1"]}), "not a peer id"),
    (json.dumps({"peer_id": PEER, "maddrs": ["/ip4/1.2.3.4/tcp/1"] * (r.MAX_MADDRS + 1)}), "addresses >"),
    (json.dumps({"peer_id": PEER, "maddrs": ["/ip4/" + "1" * 300]}), "is not a string of"),
    (json.dumps({"peer_id": PEER, "maddrs": ["garbage"]}), "not a multiaddr"),
    (json.dumps({"peer_id": PEER, "maddrs": []}), "no direct address"),
    ("x" * (r.MAX_REQUEST_CHARS + 1), "characters >"),
])
def test_bad_requests_are_refused_with_the_reason(raw, error):
    with pytest.raises(r.ReachabilityError, match=error):
        r.decode_request(raw)


def test_verdict():
    assert r.verdict_of(0, 0) == "unchecked"
    assert r.verdict_of(3, 0) == "unreachable"
    assert r.verdict_of(3, 1) == "unreachable"  # most could not: a peer that only some can dial is not public
    assert r.verdict_of(2, 1) == r.verdict_of(1, 1) == "reachable"


def test_flag_chooses_without_asking_and_no_peer_means_unchecked():
    assert r.decide("client", True, [f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"], (), ()).mode == "client"
    first = r.decide("auto", True, [], ["/ip4/127.0.0.1/tcp/0"], [])
    assert (first.mode, first.check.verdict, first.chosen_by) == ("public", "unchecked", "check")
    with pytest.raises(r.ReachabilityError):
        r.decide("sometimes", True, [], (), ())


def test_a_client_mode_record_is_never_the_reference_over_a_full_peer():
    client = Record("c" * 64, priority=9.9, served=True, client=True)
    full = Record("f" * 64, priority=1.7, group=("a",), clean=True)
    assert reference_of({"c": client, "a": full})[0] == "a"
    assert reference_of({"c": client})[0] == "c"  # nobody else published: its own bytes
    assert Record.parse(client.as_dict()) == client and Record.parse(full.as_dict()) == full
