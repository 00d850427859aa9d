"""A sparse round's record: the payload and weight of every member, in the group's order, from which every member
computes the round's average (node.lowcomm.gather) and a node behind computes it again (node.lowcomm.roundlog).

A record is what the round moved, 0.33 bytes per model element per member at top-0.2 (8-bit values and a bitmask),
where the average it gives holds an f32 value at every position any member sent: 1.7 bytes per element among two
members, 2.5 among three. So a node behind replays a round for the bytes a member of it receives, and a log of a
given size holds that many more rounds.

Format (little-endian): u32 member count (1 to MAX_MEMBERS), then per member an f64 weight (finite, >= 0), a u32 byte
count and its payload (node.lowcomm.sparse, 8-bit values, at most `limit` elements: a member's top-k). A node's
update on its own offer (a round that failed or found no group) is the record of one member of weight 1: the
average of one payload is that payload's values, bit for bit.
"""
from __future__ import annotations

import math
import os
import struct
from typing import NamedTuple, Protocol, Sequence

import torch

from dtrain.node.lowcomm import sparse

MAX_MEMBERS = 16  # members of a round a record may carry (a larger group's round is not logged: download)
COUNT = struct.Struct("<I")
MEMBER = struct.Struct("<dI")  # weight, payload bytes


class BadRecord(ValueError):
    """Bytes that are not a round's record in this format, for a model of this size."""


class Sliceable(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, key: slice) -> bytes: ...


class Member(NamedTuple):
    weight: float
    offset: int  # where its payload starts in the record
    length: int


def max_bytes(members: int, total: int, limit: int) -> int:
    """The largest record of `members` payloads of a `total`-element model, each of at most `limit` elements."""
    return COUNT.size + members * (MEMBER.size + sparse.payload_bytes(limit, total, quantized=True))


def bytes_per_element(members: int, fraction: float) -> float:
    """A record's bytes per model element, about: `members` payloads of top-`fraction`."""
    return members * sparse.bytes_per_element(fraction)


def write(fd: int, members: Sequence[tuple[float, bytes]]) -> int:
    """The record of `members` (weight, payload) written over the file `fd` holds (from its start, and nothing after
    it), a payload at a time: no copy of the whole record. Returns its size."""
    if not 1 <= len(members) <= MAX_MEMBERS:
        raise BadRecord(f"{len(members)} members; a record carries 1 to {MAX_MEMBERS}")
    os.ftruncate(fd, 0)
    at = pwrite_all(fd, COUNT.pack(len(members)), 0)
    for weight, payload in members:
        at = pwrite_all(fd, MEMBER.pack(weight, len(payload)), at)
        at = pwrite_all(fd, payload, at)
    return at


def encode(members: Sequence[tuple[float, bytes]]) -> bytes:
    if not 1 <= len(members) <= MAX_MEMBERS:
        raise BadRecord(f"{len(members)} members; a record carries 1 to {MAX_MEMBERS}")
    return b"".join([COUNT.pack(len(members)), *(MEMBER.pack(w, len(p)) + p for w, p in members)])


def pread_all(fd: int, size: int, at: int) -> bytes:
    """`size` bytes at `at` of the file `fd` (a read may in principle come short); OSError if the file ends first."""
    out = bytearray()
    while len(out) < size:
        piece = os.pread(fd, size - len(out), at + len(out))
        if not piece:
            raise OSError(f"the file ended at byte {at + len(out)}, {size - len(out)} bytes short")
        out += piece
    return bytes(out)


def pwrite_all(fd: int, data: bytes, at: int) -> int:
    """`data` written whole at `at` in the file `fd`; returns where it ends."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written
    return at


def parse(data: Sliceable, total: int, limit: int) -> list[Member]:
    """Where each member's payload lies in `data` (bytes, or node.lowcomm.roundlog.OnDisk), checked down to each
    payload's header and size; its positions and values are checked when it is decoded (`average_into`)."""
    size = len(data)
    if size < COUNT.size:
        raise BadRecord(f"a record of {size} bytes has no member count")
    (count,) = COUNT.unpack(data[0:COUNT.size])
    if not 1 <= count <= MAX_MEMBERS:
        raise BadRecord(f"{count} members; a record carries 1 to {MAX_MEMBERS}")
    members, at = [], COUNT.size
    for i in range(count):
        if size - at < MEMBER.size + sparse.HEADER.size:
            raise BadRecord(f"member {i} is truncated at byte {at} of {size}")
        weight, length = MEMBER.unpack(data[at:at + MEMBER.size])
        at += MEMBER.size
        if not (math.isfinite(weight) and weight >= 0):
            raise BadRecord(f"member {i} has weight {weight}")
        if length > size - at:
            raise BadRecord(f"member {i} claims {length} bytes, {size - at} left")
        magic, elements, _, kind = sparse.HEADER.unpack(data[at:at + sparse.HEADER.size])
        if magic != sparse.MAGIC or kind != sparse.I8 or elements > limit \
                or length != sparse.payload_bytes(elements, total, quantized=True):
            raise BadRecord(f"member {i}: not an 8-bit payload of at most {limit} of {total} elements "
                            f"({length} bytes, {elements} elements)")
        members.append(Member(weight, at, length))
        at += length
    if at != size:
        raise BadRecord(f"{size - at} bytes after the last member")
    return members


def average_into(data: Sliceable, members: Sequence[Member], out: Sequence[torch.Tensor], total: int,
                 limit: int) -> None:
    """The round's average written into `out` (fp32 tensors that together are the model in its flat order): what
    its members computed, bit for bit (node.lowcomm.sparse.average_into, one member's payload decoded at a time).
    sparse.BadPayload for a payload whose positions or values are not the codec's."""
    payloads = (sparse.decode(data[m.offset:m.offset + m.length], total, limit, quantized=True) for m in members)
    sparse.average_into(payloads, [m.weight for m in members], out)
