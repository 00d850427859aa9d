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
