"""Buffers for large request bodies (DGRD packets) that do not pay a page fault for every 4 KiB they hold, and whose
memory serves the next bodies once a body is gone.

A packet body is written once, into memory the process has not touched before: the node's pool keeps accepted
packets until the training thread takes them, so a body rarely lands in memory freed by an earlier one. Writing 4 MB
of fresh 4 KiB pages costs ~1000 page faults; inside a node (a process of several GB with torch's and hivemind's
threads) each cost about 10 us, so `bytearray(length)` took ~10 ms of a 14 ms Mode 2 request (py-spy).
A private anonymous mapping with MADV_HUGEPAGE faults in 2 MiB at a time: two faults for a 4 MB packet.

Fresh memory costs more than its faults on a VM that hands free memory back to its host (virtio-balloon free page
reporting, as on the machines this project runs on): the kernel reports free 2 MiB blocks to the host, which
discards them, and the next process to touch one waits for the host to back it again. Writing 4 MB into fresh huge
pages took 1.1 ms right after another process had freed memory, and 5.0-6.5 ms after 20 s of quiet (same code).
So a body's mapping is not unmapped when the body dies: `BodyArena` keeps it, resident, for the next body of its
size class, up to `idle_bytes` of such mappings.

Ownership needs no bookkeeping: the array returned keeps its mapping alive (numpy's `base`), and every view of it
(a decoded packet's sections) keeps the array alive, so the mapping goes back to the arena when the last view is
gone and not before (a `weakref.finalize` on the array, run on whichever thread drops it).

A body that cannot reuse one (the pool still holds the earlier ones: every body between two updates) would still
be written into fresh memory while its request waits. So the node's arena also keeps a reserve: after a body of a
size class is taken, a background thread maps up to `reserve` more of that class and has the kernel fault them in
(MADV_POPULATE_WRITE), once no body has been taken for `quiet_s`: the work moves into the time between uploads, off
every request, and never competes with a body arriving. Uploads that come faster than that find the reserve empty
and fault their own memory, as without it.

Cost: resident memory is rounded up to whole huge pages, at most 2 MiB over the body per body held, plus up to
`idle_bytes` kept for the next bodies (reserve included); without transparent huge pages
(``/sys/kernel/mm/transparent_hugepage/enabled`` = never) the advice is ignored and this is a plain anonymous mapping,
faulted 4 KiB at a time as before. Where the kernel lacks MADV_POPULATE_WRITE (before Linux 5.14) there is no reserve.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import weakref
from typing import Union

import numpy as np
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

HUGE_PAGE_BYTES = 2 << 20  # an x86-64 / arm64 (4 KiB base pages) transparent huge page
# below this a body stays an ordinary bytearray: it would not fill one huge page
MIN_HUGE_BODY_BYTES = 1 << 20
# mappings kept for the next bodies: 16 Mode 2 packets of GPT-2 small at 1%, 6 of Mode 1; a dense packet of every
# transformer block (170 MB) is larger and is unmapped when it dies
IDLE_BYTES = 64 << 20
# the node's reserve: warm mappings made ahead per size class, within IDLE_BYTES (4 Mode 2 packets of GPT-2 small)
RESERVE_BODIES = 4
# the reserve is refilled once no body has been taken for this long: a 4 MB body arrives on loopback in about 3 ms
QUIET_S = 0.02
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the range in, writable, as a write to every page would

Body = Union[bytearray, np.ndarray]  # what `body_buffer` returns: a writable, C-contiguous buffer of bytes


def _address(mapping: mmap.mmap) -> int:
    pointer = ctypes.c_char.from_buffer(mapping)  # an export of the mapping: released before it is returned
    try:
        return ctypes.addressof(pointer)
    finally:
        del pointer


_libc = ctypes.CDLL(None, use_errno=True)  # madvise through ctypes: the GIL is released while the kernel faults


def _populate(address: int, length: int) -> str | None:
    """Fault [address, address + length) in, writable; None when done, or why not (EINVAL before Linux 5.14)."""
    if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE) == 0:
        return None
    return f"madvise(MADV_POPULATE_WRITE): {os.strerror(ctypes.get_errno())}"


def mapping_bytes(length: int) -> int:
    """The size class of a body of `length` bytes: its mapping, in whole huge pages, with one of slack so that the
    body can start at a 2 MiB boundary (the kernel usually aligns a mapping this large already) and its last partial
    huge page lies inside the mapping, so it is one too."""
    return -(-length // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES + HUGE_PAGE_BYTES


class BodyArena:
    """Thread-safe: the event loop takes buffers, whichever thread drops a body's last view gives its mapping back,
    and a daemon thread (started by the first take, with `reserve` > 0) fills the reserve."""

    def __init__(self, idle_bytes: int = IDLE_BYTES, reserve: int = 0, quiet_s: float = QUIET_S):
        self.idle_bytes = idle_bytes  # bound on the mappings kept for the next bodies, reserve included
        self.reserve, self.quiet_s = reserve, quiet_s  # warm mappings wanted per size class taken; 0: none made
        self._idle: dict[int, list[tuple[mmap.mmap, int]]] = {}  # size class -> (mapping, offset of its 2 MiB page)
        self._held = 0  # bytes of the mappings in _idle
        self._last_take = 0.0  # time.monotonic() of the last huge body handed out
        self._wanted: dict[int, None] = {}  # size classes taken, the most recent last: the reserve's order
        self._changed = threading.Condition(threading.Lock())  # guards all of the above
        self._filler: threading.Thread | None = None

    @property
    def held_bytes(self) -> int:
        with self._changed:
            return self._held

    def buffer(self, length: int) -> Body:
        """A writable buffer of `length` bytes (contents undefined), in huge pages when it is large enough."""
        if length < MIN_HUGE_BODY_BYTES:
            return bytearray(length)
        size = mapping_bytes(length)
        with self._changed:
            idle = self._idle.get(size)
            mapping, start = idle.pop() if idle else (None, 0)
            if mapping is not None:
                self._held -= size
            self._last_take = time.monotonic()
            if self.reserve:
                self._wanted.pop(size, None)
                self._wanted[size] = None
                self._changed.notify()
                if self._filler is None:
                    self._filler = threading.Thread(target=self._fill, name="body-reserve", daemon=True)
                    self._filler.start()
        if mapping is None:
            mapping, start = self._map(size)
        body = np.frombuffer(mapping, np.uint8, count=length, offset=start)
        weakref.finalize(body, self._give_back, mapping, start, size).atexit = False
        return body

    @staticmethod
    def _map(size: int) -> tuple[mmap.mmap, int]:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = -_address(mapping) % HUGE_PAGE_BYTES  # a multiple of the 4 KiB page: madvise's start must be
        mapping.madvise(mmap.MADV_HUGEPAGE, start, size - start)
        return mapping, start

    def _give_back(self, mapping: mmap.mmap, start: int, size: int) -> None:
        """The body over `mapping` is gone: keep the mapping for the next body of its size, or let it be unmapped."""
        with self._changed:
            if self._held + size <= self.idle_bytes:
                self._idle.setdefault(size, []).append((mapping, start))
                self._held += size
                return
        # over the bound: unmapped when the last reference goes (the array's own export is released right after)

    def _next_to_fill(self) -> tuple[int | None, float]:
        """(the size class the reserve fills next, the most recently taken first, or None; seconds to wait before
        it may). Under the lock."""
        for size in reversed(self._wanted):
            if len(self._idle.get(size, ())) < self.reserve and self._held + size <= self.idle_bytes:
                return size, self._last_take + self.quiet_s - time.monotonic()
        return None, 0.0

    def _fill(self) -> None:
        """The reserve's thread: one warm mapping at a time, each after `quiet_s` without a take."""
        while True:
            with self._changed:
                size, wait = self._next_to_fill()
                while size is None or wait > 0:
                    self._changed.wait(None if size is None else wait)
                    size, wait = self._next_to_fill()
            try:
                mapping, start = self._map(size)
                failed = _populate(_address(mapping) + start, size - HUGE_PAGE_BYTES)  # all a body of its size uses
            except OSError as e:  # no address space or memory left: the requests will say so themselves
                failed = f"mapping {size} bytes: {e}"
            if failed:
                logger.warning(f"request bodies fault their own memory from now on: {failed}")
                with self._changed:
                    self.reserve = 0
                return
            self._give_back(mapping, start, size)


ARENA = BodyArena(reserve=RESERVE_BODIES)


def body_buffer(length: int) -> Body:
    """A buffer of `length` bytes from the node's arena (`BodyArena.buffer`)."""
    return ARENA.buffer(length)
