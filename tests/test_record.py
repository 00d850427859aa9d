"""A sparse round's record (node.lowcomm.record): the bytes written to a file and encoded in memory are the same,
every malformed record is refused, and its average is the bits of the members' own average."""
from __future__ import annotations

import struct
import tempfile

import pytest
import torch

from dtrain.node.lowcomm import record, sparse

pytestmark = pytest.mark.unit

TOTAL, LIMIT = 1000, 100


def offer(seed: int, count: int = 60) -> bytes:
    """A member's payload as a node sends it: top-k values, 8-bit."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.zeros(TOTAL)
    flat[torch.randperm(TOTAL, generator=g)[:count]] = torch.randn(count, generator=g)
    return sparse.encode(sparse.quantize([flat])[0], quantized=True)


def test_a_record_written_to_a_file_is_the_record_encoded_in_memory():
    members = [(8.0, offer(1)), (0.0, offer(2)), (16.0, offer(3, count=100))]
    with tempfile.TemporaryFile() as f:
        f.write(b"an older, longer record" * 1000)  # written over: nothing of it is left
        size = record.write(f.fileno(), members)
        f.seek(0)
        written = f.read()
    assert written == record.encode(members) and size == len(written)
    parsed = record.parse(written, TOTAL, LIMIT)
    assert [(m.weight, written[m.offset:m.offset + m.length]) for m in parsed] == members
    assert record.max_bytes(3, TOTAL, LIMIT) >= len(written)


def test_its_average_is_the_members_average_and_one_members_is_that_payload():
    members = [(8.0, offer(1)), (8.0, offer(2)), (16.0, offer(3))]
    data = record.encode(members)
    out = [torch.full((600,), 7.0), torch.full((400,), 7.0)]  # what was there before goes
    record.average_into(data, record.parse(data, TOTAL, LIMIT), out, TOTAL, LIMIT)
    expected = sparse.average([sparse.decode(p, TOTAL, LIMIT, quantized=True) for _, p in members],
                              [w for w, _ in members], TOTAL)
    assert torch.cat(out).numpy().tobytes() == expected.numpy().tobytes()
    # a node's update on its own offer: the record of one member of weight 1 gives the offer's bits
    own = record.encode([(1.0, offer(4))])
    flat = torch.empty(TOTAL)
    record.average_into(own, record.parse(own, TOTAL, LIMIT), [flat], TOTAL, LIMIT)
    idx, values = sparse.decode(offer(4), TOTAL, LIMIT, quantized=True)
    dense = torch.zeros(TOTAL)
    dense[idx.long()] = values
    assert flat.numpy().tobytes() == dense.numpy().tobytes()


def test_every_malformed_record_is_refused():
    good = record.encode([(1.0, offer(1)), (2.0, offer(2))])
    f32 = sparse.encode(torch.where(torch.arange(TOTAL) % 50 == 0, 1.5, 0.0))  # 20 values, unquantized
    member = lambda w, p: record.MEMBER.pack(w, len(p)) + p  # noqa: E731
    bad = {
        "empty": b"",
        "no members": record.COUNT.pack(0),
        "too many members": record.COUNT.pack(record.MAX_MEMBERS + 1) + good[4:],
        "fewer members than it says": record.COUNT.pack(3) + good[4:],
        "truncated": good[:-1],
        "trailing bytes": good + b"\0",
        "a negative weight": record.COUNT.pack(1) + member(-1.0, offer(1)),
        "a weight that is not a number": record.COUNT.pack(1) + member(float("nan"), offer(1)),
        "a longer payload than the record": record.COUNT.pack(1) + struct.pack("<dI", 1.0, 10 ** 6) + offer(1),
        "f32 values": record.COUNT.pack(1) + member(1.0, f32),
        "more elements than a member sends": record.COUNT.pack(1) + member(1.0, offer(1, count=LIMIT + 1)),
        "not a payload": record.COUNT.pack(1) + member(1.0, b"X" * 20),
    }
    for what, data in bad.items():
        with pytest.raises(record.BadRecord):
            record.parse(data, TOTAL, LIMIT)
            pytest.fail(what)
    with pytest.raises(record.BadRecord):
        record.encode([])
    # a payload whose header is right and whose bitmask is not: refused when it is decoded
    broken = bytearray(offer(1))
    broken[sparse.HEADER.size] ^= 0xFF
    data = record.encode([(1.0, bytes(broken))])
    with pytest.raises(sparse.BadPayload):
        record.average_into(data, record.parse(data, TOTAL, LIMIT), [torch.empty(TOTAL)], TOTAL, LIMIT)


def test_a_record_costs_what_its_members_sent():
    assert record.bytes_per_element(3, 0.2) == pytest.approx(3 * (1 / 8 + 0.2 * (1 + 1 / 64)))
    assert len(record.encode([(1.0, offer(1)), (1.0, offer(2))])) == 4 + 2 * (12 + len(offer(1)))
