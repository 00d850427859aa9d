"""Buffers for large request bodies (DGRD packets) that do not pay a page fault for every 4 KiB they hold.

A packet body is written once, into memory the process has not touched before: the node's pool keeps accepted
packets until the training thread takes them, so a body rarely lands in memory freed by an earlier one. Writing 4 MB
of fresh 4 KiB pages costs ~1000 page faults; inside a node (a process of several GB with torch's and hivemind's
threads) each cost about 10 us, so `bytearray(length)` took ~10 ms of a 14 ms Mode 2 request (py-spy, issue #12).
A private anonymous mapping with MADV_HUGEPAGE faults in 2 MiB at a time: two faults for a 4 MB packet.

Ownership needs no bookkeeping: the array returned keeps its mapping alive (numpy's `base`), and every view of it
(a decoded packet's sections) keeps the array alive, so the mapping is unmapped, and its memory given back to the
system, when the last view is gone and not before.

Cost: resident memory is rounded up to whole huge pages, at most 2 MiB over the body per body held; without
transparent huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` = never) the advice is ignored and this
is a plain anonymous mapping, faulted 4 KiB at a time as before.
"""
from __future__ import annotations

import ctypes
import mmap
from typing import Union

import numpy as np

HUGE_PAGE_BYTES = 2 << 20  # an x86-64 / arm64 (4 KiB base pages) transparent huge page
# below this a body stays an ordinary bytearray: it would not fill one huge page
MIN_HUGE_BODY_BYTES = 1 << 20

Body = Union[bytearray, np.ndarray]  # what `body_buffer` returns: a writable, C-contiguous buffer of bytes


def _address(mapping: mmap.mmap) -> int:
    pointer = ctypes.c_char.from_buffer(mapping)  # an export of the mapping: released before it is returned
    try:
        return ctypes.addressof(pointer)
    finally:
        del pointer


def body_buffer(length: int) -> Body:
    """A writable buffer of `length` bytes (contents undefined), in huge pages when it is large enough."""
    if length < MIN_HUGE_BODY_BYTES:
        return bytearray(length)
    # One huge page of slack: the body starts at the first 2 MiB boundary of the mapping (the kernel usually aligns
    # a mapping this large already), and its last partial huge page lies inside the mapping, so it is one too.
    size = length + HUGE_PAGE_BYTES
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -_address(mapping) % HUGE_PAGE_BYTES  # a multiple of the 4 KiB page: madvise's start must be
    mapping.madvise(mmap.MADV_HUGEPAGE, start, size - start)
    return np.frombuffer(mapping, np.uint8, count=length, offset=start)
