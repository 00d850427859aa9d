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
        self._delta = [torch.zeros_like(p) for p in self.params]  # set aside by enter_outer
        self.steps = 0  # inner updates since the anchor (carried ones included)
        self.in_outer = False

    @property
    def due(self) -> bool:
        return self.steps >= self.inner_steps

    def inner_step(self, grads: Sequence[torch.Tensor]) -> None:
        """One AdamW update of the node's parameters with this (mean) gradient."""
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(torch.as_tensor(g).view_as(p))
        self.inner.step()
        self.steps += 1

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """anchor - parameters (what enter_outer set aside, while in an outer round)."""
        if self.in_outer:
            return [d.clone() for d in self._delta]
        with torch.no_grad():
            return [a - p.detach() for a, p in zip(self.anchor, self.params)]

    def enter_outer(self) -> None:
        with torch.no_grad():
            for a, p, d in zip(self.anchor, self.params, self._delta):
                torch.sub(a, p, out=d)
                p.copy_(a)
        self.in_outer = True

    def leave_outer(self) -> None:
        """No outer update happened: back to the inner updates' parameters."""
        if not self.in_outer:
            return
        with torch.no_grad():
            for a, p, d in zip(self.anchor, self.params, self._delta):
                torch.sub(a, d, out=p.data)
        self.in_outer = False

    def settle(self) -> None:
        """The parameters hold an outer update that applied this node's pseudo-gradient: the next anchor."""
        with torch.no_grad():
            for a, p, d in zip(self.anchor, self.params, self._delta):
                a.copy_(p)
                d.zero_()
        self.steps, self.in_outer = 0, False

    def carry(self) -> None:
        """The parameters hold the swarm's bytes without this node's pseudo-gradient: they become the anchor and the
        pseudo-gradient goes back on top of them, for the next round."""
        if not self.in_outer:
            raise RuntimeError("carry() without enter_outer(): the pseudo-gradient was not set aside")
        with torch.no_grad():
            for a, p, d in zip(self.anchor, self.params, self._delta):
                a.copy_(p)
                p.sub_(d)
            for d in self._delta:
                d.zero_()
        self.in_outer = False

    def absorb(self) -> None:
        """Alone: the inner update just made is the swarm's update (the spec's single server): new anchor."""
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params):
                a.copy_(p)
        self.steps = 0
