"""What a node knows of the other peers before its presence and contact exist (node.swarm.others): no one, unless
its swarm has no announcements and takes them to be present (the adapter's). Filled in, it reads them: the contact
part between real DHTs is in test_contact_swarm.py."""
from __future__ import annotations

import pytest

from dtrain.node.swarm.others import AlwaysPresent, Others

pytestmark = pytest.mark.unit


def test_before_the_dht_runs_the_node_knows_of_no_one():
    others = Others()
    assert not others.present() and others.announced() == {} and others.ended() == {} and not others.isolated()
    others.reach_now()  # nothing to ping: no contact yet
    assert AlwaysPresent().present() and AlwaysPresent().announced() == {}

