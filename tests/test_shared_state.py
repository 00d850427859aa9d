"""The parameters and the optimizer's state stay in shared memory (node.swarm.state.keep_state_shared), so
handing them to a downloading peer never moves a tensor the training thread is using: after the start, every step
and every load, pickling them for a pipe (as hivemind does) leaves every tensor's memory where it was."""
from __future__ import annotations

import io
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from dtrain.node.lowcomm.outer import OuterNesterov
from dtrain.node.swarm.state import keep_state_shared

pytestmark = pytest.mark.unit


def _state_tensors(opt):
    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def _pickle_moves_nothing(opt) -> None:
    tensors = _state_tensors(opt) + [p for group in opt.param_groups for p in group["params"]]
    assert tensors and all(t.is_shared() for t in tensors)
    before = [t.data_ptr() for t in tensors]
    ForkingPickler(io.BytesIO()).dump(tensors)  # what hivemind's pipe does with the state it sends
    assert [t.data_ptr() for t in tensors] == before


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=1e-3),  # state made lazily, at the first step
    lambda params: OuterNesterov(params),  # state made up front
])
def test_state_is_shared_after_start_steps_and_loads(make):
    params = [torch.nn.Parameter(torch.randn(300, 300)), torch.nn.Parameter(torch.randn(7))]
    opt = keep_state_shared(make(params))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    _pickle_moves_nothing(opt)
    saved = opt.state_dict()
    opt.load_state_dict({**saved, "state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                                            for k, s in saved["state"].items()}})
    _pickle_moves_nothing(opt)


def test_without_it_pickling_moves_the_state():
    param = torch.nn.Parameter(torch.randn(300, 300))
    opt = OuterNesterov([param])
    buffer = opt.state[param]["momentum_codes"]
    before = buffer.data_ptr()
    ForkingPickler(io.BytesIO()).dump([buffer])
    assert buffer.is_shared() and buffer.data_ptr() != before  # the hazard keep_state_shared prevents


def test_a_load_keeps_the_state_tensors_hivemind_averages_in_place():
    """hivemind's state averager averages the optimizer's own state tensors (reuse_tensors): a load (a download, a
    checkpoint) puts its values into those tensors instead of replacing them."""
    params = [torch.nn.Parameter(torch.randn(50, 50)), torch.nn.Parameter(torch.randn(7))]
    opt = keep_state_shared(torch.optim.AdamW(params, lr=1e-3))
    assert all(p.grad is not None and p.grad.is_shared() and not p.grad.any() for p in params)
    for p in params:
        p.grad.copy_(torch.randn_like(p))
    opt.step()
    kept = [opt.state[p]["exp_avg"] for p in params]
    saved = opt.state_dict()
    loaded = {k: {n: v * 3 if torch.is_tensor(v) and n != "step" else v for n, v in s.items()}
              for k, s in saved["state"].items()}
    want = [loaded[i]["exp_avg"].clone() for i in range(len(params))]
    opt.load_state_dict({**saved, "state": loaded})
    assert all(opt.state[p]["exp_avg"] is k for p, k in zip(params, kept))
    assert all(torch.equal(k, w) for k, w in zip(kept, want))
    _pickle_moves_nothing(opt)
