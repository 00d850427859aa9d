"""A member's payload on the wire (node.lowcomm.gather): its epoch and length before it, so that a stream cut short
is a payload refused, not a shorter one."""
from __future__ import annotations

import pytest

from dtrain.node.lowcomm.gather import _Arriving, _TooLarge
from dtrain.node.lowcomm.roundfiles import HEADER, UNKNOWN_EPOCH, framed, framed_size, unframed

pytestmark = pytest.mark.unit


def test_a_framed_payload_comes_back_whole_and_a_cut_or_padded_one_is_refused():
    payload = bytes(range(256)) * 40
    data = framed(7, payload)
    assert len(data) == HEADER.size + len(payload) == framed_size(data[:HEADER.size])
    assert unframed(data) == (7, payload)
    assert unframed(framed(UNKNOWN_EPOCH, b"")) == (UNKNOWN_EPOCH, b"")
    for bad in (data[:-1], data + b"\0", data[:HEADER.size - 1], b"", framed(-2, payload)):
        with pytest.raises(ValueError):
            unframed(bad)


def test_a_payload_arriving_in_chunks_is_whole_at_its_declared_length_and_refused_past_it():
    data = framed(3, b"x" * 1000)
    part = _Arriving(weight=2.0, limit=len(data))
    cuts = [0, 10, 310, 610, 910, len(data) - 16]  # the header itself may arrive split
    for a, b in zip(cuts, cuts[1:]):
        part.add(data[a:b])
        assert not part.whole
    part.add(data[cuts[-1]:])
    assert part.whole and part.data() == data
    with pytest.raises(_TooLarge):
        part.add(b"y")
    lying = _Arriving(weight=1.0, limit=len(data))  # a header that declares more than a payload may have
    with pytest.raises(_TooLarge):
        lying.add(framed(3, b"x" * (len(data) + 1))[:HEADER.size + 10])
        lying.add(b"x" * len(data))
