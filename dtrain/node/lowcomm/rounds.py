"""One node's side of a low-communication round (training thread only).

The node's parameters start each round at the `anchor` (the swarm's bytes after the last outer update) and move by
inner AdamW updates on the node's data and its browsers' packets. The pseudo-gradient is anchor minus parameters.
For the outer round the parameters go back to the anchor, with the pseudo-gradient kept aside for hivemind to
average (`enter_outer`); after it:
- the update applied this node's pseudo-gradient (`settle`): the new parameters are the next anchor;
- it did not (the round failed and another peer's bytes became the swarm's, or the node was behind and downloaded the
  swarm's state): `carry` takes the parameters now held as the anchor and puts the pseudo-gradient back on top of
  them, so it goes into the next round, once, with everything trained since;
- no update happened at all (`leave_outer`): the parameters return to where the inner updates had left them.
Every call that may replace the parameters (an outer update, a download of the swarm's state) comes between
`enter_outer` and one of the three. Nothing accepted is dropped and nothing goes into two outer updates.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


class InnerRounds:
    def __init__(self, params: Sequence[torch.nn.Parameter], inner: torch.optim.Optimizer, inner_steps: int):
        if inner_steps < 1:
            raise ValueError(f"inner steps must be >= 1, got {inner_steps!r}")
        self.params = list(params)
        self.inner = inner
        self.inner_steps = inner_steps
        self.anchor = [p.detach().clone() for p in self.params]
        self._inner = [torch.zeros_like(p) for p in self.params]  # the inner updates' parameters, set aside
        self.steps = 0  # inner updates since the anchor (carried ones included)
        self.in_outer = False

    @property
    def due(self) -> bool:
        return self.steps >= self.inner_steps

    def inner_step(self, grads: Sequence[torch.Tensor]) -> None:
        """One AdamW update of the node's parameters with this (mean) gradient."""
        if self.in_outer:
            raise RuntimeError("inner_step() inside an outer round")
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(torch.as_tensor(g).view_as(p))
        self.inner.step()
        self.steps += 1

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """anchor - the inner updates' parameters."""
        with torch.no_grad():
            current = self._inner if self.in_outer else [p.detach() for p in self.params]
            return [a - q for a, q in zip(self.anchor, current)]

    def enter_outer(self) -> None:
        if self.in_outer:
            return
        with torch.no_grad():
            for a, p, q in zip(self.anchor, self.params, self._inner):
                q.copy_(p)
                p.copy_(a)
        self.in_outer = True

    def at_anchor(self) -> bool:
        """The parameters are the anchor's bytes (the ones the node serves): others may download them."""
        return not self._replaced()

    def _replaced(self) -> bool:
        return any(not torch.equal(p.detach(), a) for a, p in zip(self.anchor, self.params))

    def leave_outer(self) -> None:
        """No outer update happened: back to the inner updates' parameters, exactly."""
        if not self.in_outer:
            return
        with torch.no_grad():
            for p, q in zip(self.params, self._inner):
                p.copy_(q)
        self.in_outer = False

    def settle(self) -> None:
        """The parameters hold an outer update that applied this node's pseudo-gradient: the next anchor."""
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params):
                a.copy_(p)
        self.steps, self.in_outer = 0, False

    def carry(self) -> None:
        """The parameters hold the swarm's bytes without this node's pseudo-gradient (or still the anchor: nothing
        replaced them): they become the anchor and the pseudo-gradient goes back on top of them, for the next round."""
        if not self.in_outer:
            raise RuntimeError("carry() without enter_outer(): the pseudo-gradient was not set aside")
        if not self._replaced():
            self.leave_outer()
            return
        delta = self.pseudo_gradient()
        with torch.no_grad():
            for a, p, d in zip(self.anchor, self.params, delta):
                a.copy_(p)
                p.sub_(d)
        self.in_outer = False
