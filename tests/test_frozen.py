import gc
import weakref

import numpy as np
import pytest
import torch

from dtrain.node.config import ModelConfig
from dtrain.node.frozen import SnapshotModels, on_snapshot
from dtrain.node.model import build_model, meta_template
from dtrain.node.snapshot import make_snapshot
from tests.nodeproc import TINY_CONFIG

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def config():
    return ModelConfig.load(TINY_CONFIG)


def _trained(config, scale: float):
    model = build_model(config)
    with torch.no_grad():
        model.transformer.ln_f.weight.mul_(scale)
    return model


def test_parameters_are_the_snapshots_bytes_and_compute_what_the_model_does(config):
    model = _trained(config, 1.5)
    snap = make_snapshot(model, 3)
    frozen = on_snapshot(meta_template(config), snap.f32)
    for p, flat in zip(frozen.parameters(), snap.f32):
        assert p.data_ptr() == flat.ctypes.data and not p.requires_grad  # a view: no copy of its own
    assert frozen.lm_head.weight is frozen.transformer.wte.weight
    assert len(list(frozen.parameters())) == len(snap.f32)
    ids = torch.tensor([[5, 9, 200, 31, 7]])
    with torch.no_grad():
        assert torch.equal(frozen(input_ids=ids).logits, model(input_ids=ids).logits)


def test_trainable_differentiates_without_writing_the_snapshot(config):
    snap = make_snapshot(_trained(config, 0.5), 1)
    before = [a.copy() for a in snap.f32]
    frozen = on_snapshot(meta_template(config), snap.f32, trainable=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    grads = torch.autograd.grad(frozen(input_ids=ids, labels=ids).loss, list(frozen.parameters()))
    assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert all(np.array_equal(a, b) for a, b in zip(snap.f32, before))


def test_one_model_per_snapshot_dropped_once_a_newer_one_is_published(config):
    snaps = [make_snapshot(_trained(config, 1.0), 0)]
    models = SnapshotModels(lambda: snaps[-1], meta_template(config))
    first = models.current()
    assert models.current() is first and first.step == 1
    gone = weakref.ref(first.model)
    snaps.append(make_snapshot(_trained(config, 2.0), 1))
    models.published(snaps[-1])
    del first
    gc.collect()
    assert gone() is None  # nobody holds step 1's model: its snapshot's bytes can go
    second = models.current()
    assert second.step == 2
    assert torch.equal(second.model.transformer.ln_f.weight, 2.0 * build_model(config).transformer.ln_f.weight)


def test_refuses_a_snapshot_of_another_shape(config):
    snap = make_snapshot(build_model(config), 0)
    with pytest.raises(ValueError, match="snapshot has"):
        on_snapshot(meta_template(config), snap.f32[:-1])
