import sys

import pytest
import torch

from dtrain.node import memory

pytestmark = pytest.mark.unit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_glibc_takes_the_threshold_and_trims():
    assert memory.cap_mmap_threshold()
    assert isinstance(memory.trim(), bool)  # 1 when it released memory, 0 when there was none to release


def test_share_moves_tensors_to_shared_memory_in_place():
    t = torch.arange(1000, dtype=torch.float32)
    view = t[10:20]
    memory.share([t])
    assert t.is_shared() and torch.equal(view, torch.arange(10, 20, dtype=torch.float32))
    z = memory.shared_zeros(300)
    assert z.is_shared() and z.shape == (300,) and not z.any()


def test_shared_zeros_take_memory_only_where_touched():
    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))

    before = rss_kib()
    z = memory.shared_zeros(64 << 20)  # 256 MiB
    assert z.is_shared() and not z[:: 1 << 16].any()
    assert rss_kib() - before < 64 << 10  # a page here and there, not the whole
    z[: 16 << 20].fill_(1.0)
    assert rss_kib() - before >= 60 << 10
