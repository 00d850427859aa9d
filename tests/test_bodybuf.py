"""Request-body buffers in huge pages: their size and alignment, their pages, when their memory goes back, and the
reserve of warm memory made between uploads."""
import ctypes
import gc
import mmap
import time
from pathlib import Path

import numpy as np
import pytest

from dtrain.bridge import dgrd
from dtrain.bridge.bodybuf import HUGE_PAGE_BYTES, MIN_HUGE_BODY_BYTES, BodyArena, body_buffer, mapping_bytes
from tests.nodeproc import wait_until

pytestmark = pytest.mark.unit

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


def _resident_bytes(body: np.ndarray) -> int:
    """Bytes of the pages under `body` that are in memory now (mincore(2)): faulted in, by a write or ahead of it."""
    pages = -(-body.size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(body.ctypes.data), ctypes.c_size_t(body.size), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


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


def test_the_mapping_lives_while_a_decoded_section_does_and_then_serves_the_next_body():
    """A packet's sections are views of its body: its memory must stay theirs until the last one is gone, and then
    serve the next body of its size, without a fault or a trip through the host."""
    arena = BodyArena()
    elements = [3_000_000]
    data = dgrd.encode(1, "n", 1.0, 1, [(0, np.arange(0, 3_000_000, 2), np.ones(1_500_000))], dgrd.FLAGS_MODE2)
    body = arena.buffer(len(data))
    memoryview(body).cast("B")[:] = data
    address = body.ctypes.data
    section = dgrd.decode(body, elements).sections[0]
    del body
    gc.collect()
    assert arena.held_bytes == 0, "given back while a section still reads it"
    other = arena.buffer(len(data))
    assert other.ctypes.data != address
    other[:] = 0  # a new body written while the section lives must not change what it reads
    assert section.indices[-1] == 2_999_998 and section.values.sum() == 1_500_000  # widened from the body's bytes
    del section
    gc.collect()
    assert _mapping(address), "unmapped: the next body would fault it in again"
    assert arena.held_bytes == mapping_bytes(len(data))
    again = arena.buffer(len(data) - 1000)  # the same size class
    assert again.ctypes.data == address and arena.held_bytes == 0
    assert bytes(again[:4]) == b"DGRD"  # the same memory, as it was left: resident


def test_mappings_past_the_idle_bound_are_unmapped_and_classes_do_not_mix():
    arena = BodyArena(idle_bytes=2 * mapping_bytes(4_000_000))
    bodies = [arena.buffer(4_000_000) for _ in range(3)]
    addresses = [b.ctypes.data for b in bodies]
    del bodies
    gc.collect()
    assert arena.held_bytes == 2 * mapping_bytes(4_000_000)
    kept = [a for a in addresses if _mapping(a)]
    assert len(kept) == 2, "the third mapping should be gone: over the bound"
    larger = arena.buffer(9_000_000)  # another size class: a new mapping
    assert larger.ctypes.data not in addresses and arena.held_bytes == 2 * mapping_bytes(4_000_000)
    taken = [arena.buffer(4_000_000) for _ in range(2)]
    assert {b.ctypes.data for b in taken} == set(kept) and arena.held_bytes == 0


def test_a_body_dropped_on_another_thread_comes_back():
    """The training thread drops a hand-over's packets; the event loop takes the next buffer."""
    import threading
    arena = BodyArena()
    box = [arena.buffer(2_000_000)]
    box[0][:5] = list(b"kept!")
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    gc.collect()
    assert arena.held_bytes == mapping_bytes(2_000_000)
    assert bytes(arena.buffer(2_000_000)[:5]) == b"kept!"  # the same memory (a new mapping reads zeros)


def test_the_reserve_faults_memory_in_for_the_next_bodies_once_bodies_stop_coming():
    """A pool keeps its packets until the next update, so each body needs memory that no body has freed: the reserve
    faults it in between uploads, and not while they keep coming."""
    arena = BodyArena(reserve=2, quiet_s=2.0)
    kept = [arena.buffer(4_000_000)]  # the pool keeps them: nothing comes back to the arena
    for _ in range(3):  # takes closer together than quiet_s: nothing is made ahead meanwhile
        time.sleep(0.1)
        kept.append(arena.buffer(4_000_000))
        assert arena.held_bytes == 0
    assert [_resident_bytes(b) for b in kept] == [0] * 4, "fresh memory: the request writing it faults it in"
    wait_until(lambda: arena.held_bytes == 2 * mapping_bytes(4_000_000), 15, "the reserve", interval_s=0.05)
    time.sleep(0.3)
    assert arena.held_bytes == 2 * mapping_bytes(4_000_000), "made `reserve` ahead, no more"
    warm = [arena.buffer(4_000_000) for _ in range(2)]
    assert {b.ctypes.data for b in warm}.isdisjoint(b.ctypes.data for b in kept)
    assert all(_resident_bytes(b) >= b.size for b in warm), "in memory before its first write"


def test_the_reserve_stays_within_the_idle_bound_the_latest_size_first():
    arena = BodyArena(idle_bytes=mapping_bytes(4_000_000), reserve=2, quiet_s=0.05)
    kept = [arena.buffer(2_000_000), arena.buffer(4_000_000)]  # two size classes, the larger taken last
    wait_until(lambda: arena.held_bytes == mapping_bytes(4_000_000), 15, "the reserve", interval_s=0.05)
    time.sleep(0.3)
    assert arena.held_bytes == mapping_bytes(4_000_000), "the bound has room for one mapping of the latest class"
    warm = arena.buffer(4_000_000)
    assert _resident_bytes(warm) >= warm.size and _resident_bytes(kept[1]) == 0
