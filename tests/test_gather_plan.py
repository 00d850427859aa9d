"""Who calls whom in the sparse round's exchange (node.lowcomm.gather.plan): every member ends up with every payload,
each pair that can connect uses one stream, nobody dials a client-mode member, and without client-mode members
nobody relays: each member sends its payload once to each other member."""
from __future__ import annotations

import itertools

import pytest
from hivemind.p2p import PeerID

from dtrain.node.lowcomm.gather import plan
from dtrain.node.swarm.records import RecordOwner

pytestmark = pytest.mark.unit


def _peers(n: int) -> list[PeerID]:
    return [PeerID.from_base58(RecordOwner.generate().peer_id) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_every_member_gets_every_payload_over_one_stream_per_pair(n):
    members = _peers(n)
    for full in itertools.product([True, False], repeat=n):
        plans = {m: plan(members, full, m) for m in members}
        if not any(full):
            assert all(p is None for p in plans.values())
            continue
        for me in members:
            mine = plans[me]
            callers = {m for m in members if me in plans[m].dial}
            assert callers == mine.accept, "a member accepts exactly the members that call it"
            assert not set(mine.dial) & mine.accept, "one stream per pair"
            got = {me} | callers
            for callee in mine.dial:
                got |= set(plans[callee].answer(callee, me))
            assert got == set(members), f"full={full}: {me} misses payloads"
            assert all(full[members.index(d)] for d in mine.dial), "nobody dials a client-mode member"
        if all(full):  # every member sends its payload once to each other member, none relays
            sent = {m: len(plans[m].dial) + len(plans[m].accept) for m in members}
            assert set(sent.values()) == {n - 1}
