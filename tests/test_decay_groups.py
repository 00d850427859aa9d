"""GPT-2's weight-decay grouping of the node's AdamW, on the real model: which tensors decay, the order hivemind and
the manifest rely on, and checkpoints written with one group."""
from __future__ import annotations

import pytest
import torch

from dtrain.node.config import ModelConfig, TrainConfig
from dtrain.node.model import build_model
from dtrain.node.train.adamw import decay_groups, make_local_optimizer, regroup_state_dict
from tests.nodeproc import TINY_CONFIG

pytestmark = pytest.mark.unit


@pytest.fixture()
def model():
    return build_model(ModelConfig.load(TINY_CONFIG))


def test_matrices_decay_and_biases_and_layernorms_do_not(model):
    groups = decay_groups(model, 0.1)
    flat = [p for g in groups for p in g["params"]]
    assert [id(p) for p in flat] == [id(p) for p in model.parameters()]  # the manifest's order, unchanged
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    names = dict(model.named_parameters())
    for name, p in names.items():
        expected = 0.0 if (name.endswith(".bias") or ".ln_" in name or name.startswith("transformer.ln_f")) else 0.1
        assert decay_of[id(p)] == expected, name
    assert any(".ln_" in n for n in names) and any(n.endswith(".bias") for n in names)
    assert all(a["weight_decay"] != b["weight_decay"] for a, b in zip(groups, groups[1:]))  # runs, merged
    assert len(decay_groups(model, 0.0)) == 1


def test_a_zero_gradient_step_decays_only_the_matrices(model):
    train = TrainConfig(learning_rate=0.5, weight_decay=0.2)
    opt = make_local_optimizer(model, train)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            torch.testing.assert_close(p.detach(), before[name] * (1 - 0.5 * 0.2))
        else:
            assert torch.equal(p.detach(), before[name]), name


def test_a_one_group_checkpoint_loads_into_the_groups(model):
    params = list(model.parameters())
    old = torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)  # how the state was saved before the grouping
    for p in params:
        p.grad = torch.randn_like(p)
    old.step()
    saved = old.state_dict()
    opt = make_local_optimizer(model, TrainConfig(learning_rate=0.01, weight_decay=0.01))
    with pytest.raises(ValueError):
        opt.load_state_dict(saved)
    opt.load_state_dict(regroup_state_dict(saved, opt))
    for p in params:
        torch.testing.assert_close(opt.state[p]["exp_avg"], old.state[p]["exp_avg"], rtol=0, atol=0)
    assert [g["weight_decay"] for g in opt.param_groups] == [g["weight_decay"] for g in decay_groups(model, 0.01)]
    truncated = {"state": saved["state"], "param_groups": [{**saved["param_groups"][0],
                                                            "params": saved["param_groups"][0]["params"][:-1]}]}
    with pytest.raises(ValueError, match="parameters"):
        regroup_state_dict(truncated, opt)
