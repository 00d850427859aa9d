"""The identity a node's p2pd starts with (node.swarm.records.identity_kwargs): the key its records are signed with,
and hivemind's check for a running peer of the same identity only where one can exist, a file used before."""
from __future__ import annotations

import os

import pytest

from dtrain.node.swarm.records import RecordOwner, identity_kwargs

pytestmark = pytest.mark.unit


def test_only_an_identity_file_used_before_is_checked_for_a_running_peer(tmp_path):
    owner = RecordOwner.generate()
    path = tmp_path / "node.identity"
    owner.write_identity(path)
    with identity_kwargs(owner, str(path)) as used_before:
        assert used_before == dict(identity_path=str(path))  # hivemind's default: checked
    with identity_kwargs(owner, str(path), fresh=True) as fresh:
        assert fresh == dict(identity_path=str(path), check_if_identity_free=False)
    with identity_kwargs(owner) as temporary:
        kept = temporary["identity_path"]
        assert temporary["check_if_identity_free"] is False
        assert RecordOwner.from_identity(kept).peer_id == owner.peer_id  # p2pd starts as the records' peer
    assert not os.path.exists(kept)
