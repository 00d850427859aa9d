"""Request-body buffers in huge pages: their size and alignment, their pages, and when their memory goes back."""
import gc
from pathlib import Path

import numpy as np
import pytest

from bridge import dgrd
from bridge.bodybuf import HUGE_PAGE_BYTES, MIN_HUGE_BODY_BYTES, body_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping(address: int) -> dict:
    """The /proc/self/smaps entry (its range and fields, in kB) of the mapping holding `address`; {} when none."""
    entry: dict = {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            if entry:
                return entry
            if start <= address < end:
                entry = {"range": (start, end)}
        elif entry and line.split()[-1] == "kB":
            entry[head.rstrip(":")] = int(line.split()[1])
        elif entry and head == "VmFlags:":
            entry["VmFlags"] = line.split()[1:]
    return entry


def test_small_bodies_stay_bytearrays():
    body = body_buffer(MIN_HUGE_BODY_BYTES - 1)
    assert isinstance(body, bytearray) and len(body) == MIN_HUGE_BODY_BYTES - 1


@pytest.mark.parametrize("length", [MIN_HUGE_BODY_BYTES, 4_030_358, 3 * HUGE_PAGE_BYTES])
def test_large_body_is_writable_exact_and_starts_on_a_huge_page(length):
    body = body_buffer(length)
    assert body.dtype == np.uint8 and body.size == length and body.flags.writeable and body.flags.c_contiguous
    assert body.ctypes.data % HUGE_PAGE_BYTES == 0
    view = memoryview(body).cast("B")
    view[-3:] = b"end"
    assert bytes(body[-3:]) == b"end"


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off")
def test_a_written_body_is_in_huge_pages():
    body = body_buffer(4_030_358)
    body[:] = 7  # what read_body does: every byte written once
    entry = _mapping(body.ctypes.data)
    # The mapping is advised huge pages ("hg"), and the kernel faulted it in 2 MiB at a time. It grants huge pages
    # as it has them free: one of the two a 4 MB body spans came as 4 KiB pages once in CI (a fragmented machine).
    assert "hg" in entry["VmFlags"], entry
    assert entry["AnonHugePages"] >= HUGE_PAGE_BYTES // 1024, entry


def test_the_mapping_lives_while_a_decoded_section_does_and_goes_after():
    """A packet's sections are views of its body: the body's memory must stay until the last one is gone."""
    elements = [3_000_000]
    data = dgrd.encode(1, "n", 1.0, 1, [(0, np.arange(0, 3_000_000, 2), np.ones(1_500_000))], dgrd.FLAGS_MODE2)
    body = body_buffer(len(data))
    memoryview(body).cast("B")[:] = data
    address = body.ctypes.data
    section = dgrd.decode(body, elements).sections[0]
    del body
    gc.collect()
    assert _mapping(address), "unmapped while a section still reads it"
    assert section.indices[-1] == 2_999_998 and section.values.sum() == 1_500_000  # widened from the body's bytes
    del section
    gc.collect()
    assert not _mapping(address), "the body's mapping outlived every view of it"
