import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dtrain.node import memory

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_glibc_takes_the_threshold_and_trims():
    assert memory.cap_mmap_threshold()
    assert isinstance(memory.trim(), bool)  # 1 when it released memory, 0 when there was none to release


_PASSES = """
import resource, sys, torch
from dtrain.node import memory
assert (memory.cap_mmap_threshold if sys.argv[1] == "cap" else memory.reuse_freed_blocks)()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # 4 MiB weights and gradients
x = torch.randn(512, 1024)  # 2 MiB activations
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def train_pass():
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
for _ in range(3):  # the heap grows to a pass's size once
    train_pass()
before = faults()
for _ in range(10):
    train_pass()
print(faults() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_training_passes_reuse_the_heap_where_the_capped_threshold_maps_fresh_pages():
    def page_faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _PASSES, mode], capture_output=True, text=True, timeout=120,
                             cwd=REPO)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    capped, reused = page_faults("cap"), page_faults("reuse")
    assert capped >= 10 * (16 << 20) // 4096  # each pass faults in its gradients and activations afresh (40 MiB)
    assert reused * 10 < capped, (capped, reused)


def test_share_moves_tensors_to_shared_memory_in_place():
    t = torch.arange(1000, dtype=torch.float32)
    view = t[10:20]
    memory.share([t])
    assert t.is_shared() and torch.equal(view, torch.arange(10, 20, dtype=torch.float32))
    z = memory.shared_zeros(300)
    assert z.is_shared() and z.shape == (300,) and not z.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tmpfs, /proc/self/map_files")
def test_share_moves_zeros_without_holding_them():
    zeros, ones = torch.zeros(16 << 20), torch.ones(16 << 20)  # 64 MiB each
    view = zeros[5:10]
    memory.share([zeros, ones])
    assert zeros.is_shared() and ones.is_shared() and ones.eq(1.0).all()
    assert _backing_bytes(ones) >= 64 << 20
    assert _backing_bytes(zeros) < 64 << 10
    view.fill_(2.0)  # still a view of the moved tensor
    assert zeros[5:10].eq(2.0).all() and zeros.sum() == 10.0


@pytest.fixture(params=["file_system", "file_descriptor"])
def sharing(request):
    """torch's two ways to share memory: file_system (hivemind sets it on import: a node's tensors) puts a header
    before the data, so a storage's bytes begin 64 bytes into its first page; file_descriptor's begin at a page."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(request.param)
    yield request.param
    torch.multiprocessing.set_sharing_strategy(before)


def _backing_bytes(t: torch.Tensor) -> int:
    """The memory the shared file behind `t` holds: its allocated blocks, whether or not a process has them mapped
    (/proc/self/map_files: the file of the mapping that holds t's first byte)."""
    address = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span = line.split(None, 1)[0]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return os.stat(f"/proc/self/map_files/{span}").st_blocks * 512
    raise LookupError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tmpfs, /proc/self/map_files")
def test_shared_zeros_take_memory_only_where_touched(sharing):
    z = memory.shared_zeros(64 << 20)  # 256 MiB, a shared file of its own
    assert z.is_shared() and z.shape == (64 << 20,)
    assert _backing_bytes(z) < 64 << 10  # the header's page at most: torch allocated the file whole, handed back
    assert not z[:: 1 << 16].any()  # a read takes the page it reads
    assert _backing_bytes(z) <= (1 << 10) * 4096 + 4096
    z[: 16 << 20].fill_(1.0)
    assert _backing_bytes(z) >= 64 << 20  # the quarter written
    assert _backing_bytes(z) < 72 << 20


def _shmem_kib() -> int:
    """Shared memory this process maps and has pages of (RssShmem: /dev/shm files, torch's shared tensors)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_REMOVE) on tmpfs")
def test_release_hands_shared_pages_back_in_every_process_that_maps_them(sharing):
    t = memory.shared_zeros(32 << 20)  # 128 MiB, a shared file of its own
    whole_pages = (128 << 20) - (4096 if t.data_ptr() % 4096 else 0)  # a first page shared with the header stays
    assert (t.data_ptr() % 4096 == 0) == (sharing == "file_descriptor")
    t.fill_(1.0)
    address = t.data_ptr()
    reader, writer = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:  # maps the same file (as hivemind's forked averager does); reads it once the parent released it
        try:
            os.read(go_r, 1)
            view = t.numpy()  # numpy: no torch thread pool in a forked child
            os.write(writer, b"z" if np.count_nonzero(view) == 0 else b"x")
        finally:
            os._exit(0)
    try:
        before = _shmem_kib()
        released = memory.release([t])
        assert released == whole_pages
        assert before - _shmem_kib() >= (whole_pages >> 10) - 1024  # the pages are gone, not just zeroed
        assert t.data_ptr() == address and t.is_shared() and not t.any()
    finally:
        os.write(go_w, b"g")
        answer = os.read(reader, 1)
        os.waitpid(child, 0)
    assert answer == b"z"  # the other process reads zeros too
    t[:1024].fill_(2.0)  # the next write takes pages again, where it writes
    assert t[:1024].eq(2.0).all() and not t[1024:].any()


def test_release_of_part_of_a_shared_storage_leaves_its_neighbours():
    page = 4096 // 4
    t = memory.shared_zeros(8 * page)
    t.fill_(3.0)
    part = t[100: 100 + 5 * page]  # begins and ends inside a page: the 4 whole pages go, the edges are zeroed
    assert memory.release([part]) == 4 * 4096
    assert not part.any()
    assert t[:100].eq(3.0).all() and t[100 + 5 * page:].eq(3.0).all()


def test_release_zeroes_private_tensors_where_they_are():
    t = torch.ones(1 << 20)
    strided = memory.shared_zeros(1 << 20)[::2].fill_(1.0)  # not contiguous
    assert memory.release([t, strided]) == 0
    assert not t.any() and not strided.any()


_LAZY_ZEROS = """
import json, torch
from dtrain.node import memory


def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


memory.cap_mmap_threshold()  # as the node runs
like = torch.empty(0).new_empty((64, 1 << 20))  # 256 MiB of shape
before = anon_kib()
z = memory.lazy_zeros(like)
shaped = list(z.shape) == list(like.shape) and z.dtype == torch.float32 and not z.any()  # reads take no page either
untouched = anon_kib() - before
z[:16].fill_(1.0)
print(json.dumps([shaped, untouched, anon_kib() - before]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's calloc")
def test_lazy_zeros_take_memory_only_where_written():
    # in a process of its own: the xdist worker's resident memory also moves with earlier tests' threads (64 MiB
    # inside the measured span in two fast-tier runs)
    out = subprocess.run([sys.executable, "-c", _LAZY_ZEROS], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    shaped, untouched, written = json.loads(out.stdout.split("\n")[-2])
    assert shaped
    assert untouched < 1024, f"{untouched} KiB held by zeros nobody wrote"
    assert written >= 60 << 10, f"{written} KiB after writing 64 MiB of them"
