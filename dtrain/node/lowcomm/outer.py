"""The outer optimizer of a low-communication round: Nesterov SGD on the averaged pseudo-gradient.

It is what hivemind.Optimizer wraps in low-communication mode, so the swarm's update applies it to the averaged
pseudo-gradients in `.grad`. The parameters hold the inner updates' values during the round: the step goes from the
round's start, which `source` gives (node.lowcomm.rounds.RoundSource), and leaves each parameter's pseudo-gradient
in its `.grad` (the average is read by then), so nobody holds a copy of the parameters for the round. A parameter
`source` gives no start for (a download replaced it, or there is no source) steps from where it is.

A node alone (`passthrough`) has no round to average: each of its inner updates is the spec's single-server update,
so the outer step leaves the parameters where the inner AdamW put them (bit for bit: the round's start minus the
pseudo-gradient would round in the last bit), or puts them back there from where `source` set them aside, and the
momentum stays as it is. With no source it applies the pseudo-gradient itself (learning rate 1, no momentum).

The momentum is the swarm's in 8 bits (node.lowcomm.momentum): each parameter's state is its codes
("momentum_codes", int8, the parameter's shape) and their scales ("momentum_scales"); a step reads it in f32, moves
the parameter with that f32 momentum and stores it rounded.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch

from dtrain.node.lowcomm import momentum as momentum8

if TYPE_CHECKING:
    from dtrain.node.lowcomm.rounds import RoundSource


class OuterNesterov(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.7, momentum: float = 0.9):
        if not lr > 0:
            raise ValueError(f"outer learning rate must be > 0, got {lr!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum!r}")
        # the block of the momentum's 8-bit form is a hyperparameter: a download carries the state in that form, and
        # nodes that keep it otherwise hold other bytes (node.swarm.agreement.hyperparameters_digest)
        super().__init__(params, dict(lr=lr, momentum=momentum, momentum_block=momentum8.BLOCK))
        self.passthrough = False
        self.source: Optional[RoundSource] = None  # the round in progress (node.lowcomm.rounds.InnerRounds.begin)
        for group in self.param_groups:  # the state exists from the start: a joiner downloads it like any other
            for p in group["params"]:
                codes, scales = momentum8.zeros(p)
                self.state[p] = {"momentum_codes": codes, "momentum_scales": scales}
        # even while the state is still, odd while a step or a load writes it: a reader that saw one even version
        # before and after its copy has one moment's momentum (node.swarm.state.ServedState)
        self.version = 0
        self.register_load_state_dict_pre_hook(lambda *_: self._bump())
        self.register_load_state_dict_post_hook(_codes_stay_int8)
        self.register_load_state_dict_post_hook(lambda *_: self._bump())

    def _bump(self) -> None:
        self.version += 1

    def momentum(self, params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The momentum of `params` in place: their codes, and their scales (node.lowcomm.momentum)."""
        states = [self.state[p] for p in params]
        return [s["momentum_codes"] for s in states], [s["momentum_scales"] for s in states]

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Its state is written from outside a step or a load (a download written into it as it arrives,
        node.swarm.state.SwarmStateAverager): the version moves on before and after it, so that no reader takes
        what it copied meanwhile for one moment's state."""
        self._bump()
        try:
            yield
        finally:
            self._bump()

    @torch.no_grad()
    def step(self, closure=None):
        self._bump()
        try:
            self._step()
        finally:
            self._bump()
        return None

    def _step(self) -> None:
        source = self.source
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                start = source.anchor(p) if source is not None else None
                if self.passthrough:
                    inner = source.inner(p) if source is not None else None
                    if inner is not None:
                        p.copy_(inner)
                    elif start is None:
                        p.sub_(p.grad)
                    continue  # else it holds the inner updates' value: where a node alone lands
                state = self.state[p]
                if start is None:
                    nesterov_(p, p.grad, state["momentum_codes"], state["momentum_scales"], lr, mu)
                else:
                    nesterov_from_(p, p.grad, state["momentum_codes"], state["momentum_scales"], start, lr, mu)
                    source.moved(p)


def _codes_stay_int8(optimizer: torch.optim.Optimizer) -> None:
    """torch's load_state_dict casts every state tensor to its parameter's dtype: the codes go back to int8 (they
    are whole numbers in [-127, 127], exact in f32)."""
    for state in optimizer.state.values():
        codes = state.get("momentum_codes")
        if torch.is_tensor(codes) and codes.dtype != torch.int8:
            state["momentum_codes"] = codes.to(torch.int8)


def _momentum_step(g: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mu: float) -> torch.Tensor:
    """Move the momentum by the average `g` (stored in 8 bits) and return the step's direction, g + mu * momentum,
    with the f32 momentum before its rounding."""
    buf = momentum8.dequantize(codes, scales).view_as(g)
    buf.mul_(mu).add_(g)
    momentum8.quantize_(buf, codes, scales)
    return g.add(buf, alpha=mu)  # Nesterov: g + mu * buf


def nesterov_(p: torch.Tensor, g: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, lr: float,
              mu: float) -> None:
    """One outer step in place. Elementwise, the momentum's rounding blockwise: a run of whole blocks of a tensor
    steps to the same bits as the whole tensor does (node.lowcomm.ranges brings downloaded ranges forward with it)."""
    p.add_(_momentum_step(g, codes, scales, mu), alpha=-lr)


def nesterov_from_(p: torch.Tensor, g: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, start: torch.Tensor,
                   lr: float, mu: float) -> None:
    """`nesterov_` of a parameter that holds the inner updates' value `q` and starts from `start`: `p` becomes what
    `nesterov_` makes of `start`, bit for bit, and `g` (the average, read by then) becomes the pseudo-gradient
    `start - q`, the bits `start - q` computes."""
    step = _momentum_step(g, codes, scales, mu)
    g.copy_(start).sub_(p)
    p.copy_(start).add_(step, alpha=-lr)
