import threading

import numpy as np
import pytest
import torch

from dtrain.node.config import ModelConfig
from dtrain.node.model import build_model
from dtrain.node.snapshot import PendingSnapshot, make_snapshot
from tests.nodeproc import TINY_CONFIG

pytestmark = pytest.mark.unit


def test_fp16_is_made_once_on_first_use_and_equals_numpys_cast():
    snap = make_snapshot(build_model(ModelConfig.load(TINY_CONFIG)), 2)
    assert snap._half._built is None  # nobody asked: no FP16 copy held
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(snap.f16)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s is seen[0] for s in seen)  # one conversion, whoever asked first
    assert all(np.array_equal(h.view(np.uint16), a.astype(np.float16).view(np.uint16)) for h, a in zip(snap.f16, snap.f32))
    whole = snap.f16_file.read()
    assert [whole[o:o + h.nbytes] for o, h in zip(snap.f16_offsets, snap.f16)] == [h.tobytes() for h in snap.f16]


def test_a_pending_snapshot_is_the_digest_of_the_parameters_and_makes_their_snapshot():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    pending = PendingSnapshot.of(model, 7)
    made, direct = pending.make(model), make_snapshot(model, 7)
    assert (pending.updates, pending.digest) == (7, direct.digest)
    assert made.digest == direct.digest and made.step == direct.step == 8
    assert all(a.tobytes() == b.tobytes() for a, b in zip(made.f32, direct.f32))
