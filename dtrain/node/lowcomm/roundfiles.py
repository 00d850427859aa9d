"""What a node offers a sparse round and what its averager's process hands back: a member's payload framed with
its epoch and length (on the wire and on file), and the two unlinked files the node and its averager share
(`RoundFiles`; node.lowcomm.gather is the exchange that uses them)."""
from __future__ import annotations

import os
import struct
import tempfile
from typing import Optional, Sequence

from dtrain.node.lowcomm import record

HEADER = struct.Struct("<qQ")  # a member's epoch and its payload's length, before the payload on the wire and on file
UNKNOWN_EPOCH = -1  # a member whose node handed no offer: its epoch is compared with no one's


def framed(epoch: int, payload: bytes) -> bytes:
    """A member's payload as it goes on the wire: its epoch and length, then the payload."""
    return HEADER.pack(epoch, len(payload)) + payload


def framed_size(head: bytes) -> int:
    """The whole size of a framed payload that begins with `head` (at least HEADER.size bytes)."""
    return HEADER.size + HEADER.unpack_from(head)[1]


def unframed(data: bytes) -> tuple[int, bytes]:
    """(epoch, payload) of a member's framed payload; ValueError if it is not one (a stream cut short included)."""
    if len(data) < HEADER.size:
        raise ValueError(f"{len(data)} bytes are no epoch and payload")
    epoch, length = HEADER.unpack_from(data)
    if epoch < UNKNOWN_EPOCH:
        raise ValueError(f"epoch {epoch} is no epoch")
    if len(data) != HEADER.size + length:
        raise ValueError(f"{len(data) - HEADER.size} bytes of a payload of {length}")
    return epoch, data[HEADER.size:]


class RoundFiles:
    """Two unlinked temporary files a node and its averager's process share (made before the fork; nothing is left
    on disk whatever happens to either): `offer`, the epoch of the node and the payload it offers in its next round
    (no payload: the averager encodes `.grad`; nothing: the epoch is unknown too), written by the node; `record`, the last round whose average the averager computed,
    written by the averager. Each is written whole before the other side reads it: the node writes its offer before
    its step, and reads a record after its round returned, before the next one begins."""

    def __init__(self):
        self._offer = tempfile.TemporaryFile(prefix="dtrain-offer-")
        self._record = tempfile.TemporaryFile(prefix="dtrain-record-")

    def hand_offer(self, epoch: int, payload: Optional[bytes]) -> None:
        """The node's next offer: the epoch its pseudo-gradient is from, and the payload (None: `.grad`'s)."""
        fd = self._offer.fileno()
        os.ftruncate(fd, 0)
        record.pwrite_all(fd, framed(epoch, payload or b""), 0)

    def offered(self) -> tuple[int, Optional[bytes]]:
        """(epoch, payload) of the node's last offer: UNKNOWN_EPOCH before the first; None for no payload."""
        fd = self._offer.fileno()
        size = os.fstat(fd).st_size
        if size < HEADER.size:
            return UNKNOWN_EPOCH, None
        epoch, payload = unframed(record.pread_all(fd, size, 0))
        return epoch, payload or None

    def offer(self) -> Optional[bytes]:
        return self.offered()[1]

    def write_record(self, members: Sequence[tuple[float, bytes]]) -> None:
        record.write(self._record.fileno(), members)

    def copy_record(self, into) -> int:
        """The last record, copied into the file `into` (in the kernel: no copy in this process); its size."""
        src, dst = self._record.fileno(), into.fileno()
        size, done = os.fstat(src).st_size, 0
        while done < size:
            n = os.copy_file_range(src, dst, size - done, done, done)
            if n <= 0:
                raise OSError(f"the round's record ended at byte {done} of {size}")
            done += n
        return size
