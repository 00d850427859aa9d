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

The gradient buffers (`.grad`) hold something only while it is used: the mean gradient of one inner update, or the
offer during an outer round. Every use writes them whole first, so in between they hold no memory
(`release_grads`, node.memory.release: their shared pages are handed back, in hivemind's averager too, which maps
the same buffers).

With a sparse codec (`fraction`), what the node offers a round (`offer`) is the top-k of its pseudo-gradient plus its
error feedback (what earlier rounds did not send), its values quantized as they travel. `settle` keeps the unsent
rest, quantization error included, as the new error feedback; `carry`
and `leave_outer` leave it as it was, since the whole pseudo-gradient goes back on the parameters.
"""
from __future__ import annotations

import warnings
from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch

from dtrain.node import memory
from dtrain.node.lowcomm import sparse


class InnerRounds:
    def __init__(self, params: Sequence[torch.nn.Parameter], inner: torch.optim.Optimizer, inner_steps: int,
                 fraction: Optional[float] = None,
                 published: Optional[Callable[[], Optional[Sequence[np.ndarray]]]] = None):
        """`published`: the fp32 arrays of the snapshot the node serves now (node.snapshot), if any. The anchor is
        the served bytes in the usual case: then it reads them there instead of holding a copy of its own (P)."""
        if inner_steps < 1:
            raise ValueError(f"inner steps must be >= 1, got {inner_steps!r}")
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction!r}")
        self.params = list(params)
        self.inner = inner
        self.inner_steps = inner_steps
        self._published = published
        self.anchor: list[torch.Tensor] = []  # read only: it may be the served snapshot's bytes
        self._anchor_own = False  # the anchor is a copy of its own (it may still be shared with the snapshot)
        self._new_anchor()
        # the inner updates' parameters, set aside during an outer round only (P less between rounds)
        self._inner: Optional[list[torch.Tensor]] = None
        self.steps = 0  # inner updates since the anchor (carried ones included)
        self.in_outer = False
        self.fraction = fraction
        # zeros that take no memory until a round leaves something unsent: a node alone never compresses (P less)
        self.feedback = [memory.lazy_zeros(p) for p in self.params] if fraction is not None else None
        self._feedback_written = False  # false: the feedback is all zeros, untouched
        self._offer: Optional[list[torch.Tensor]] = None  # what this round was offered (until settle or carry)
        self._compress = False

    def _new_anchor(self, served: Optional[Sequence[np.ndarray]] = None) -> None:
        """The parameters as they are now become the anchor: views of `served` (the fp32 arrays of the snapshot the
        node publishes next) when they hold the same bytes, else a copy of its own until `share_anchor`."""
        views = _views_of(served, self.params)
        if views is not None:
            self.anchor, self._anchor_own = views, False
            return
        with torch.no_grad():
            self.anchor = [p.detach().clone() for p in self.params]
        self._anchor_own = True

    def share_anchor(self) -> None:
        """Once per anchor, as soon as the node serves the anchor's bytes (it publishes them after the update that
        made them: node.train.trainer) and at the latest before the round's first inner update: the anchor becomes a
        view of the snapshot's fp32 arrays and its own copy goes. Equal bytes, wherever they are: nothing computed
        changes."""
        if not self._anchor_own or self._published is None:
            return
        self._anchor_own = False
        views = _views_of(self._published(), self.anchor)
        if views is not None:
            self.anchor = views

    @property
    def due(self) -> bool:
        return self.steps >= self.inner_steps

    def inner_step(self, grads: Sequence[torch.Tensor]) -> None:
        """One AdamW update of the node's parameters with this (mean) gradient."""
        if self.in_outer:
            raise RuntimeError("inner_step() inside an outer round")
        self.share_anchor()
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(torch.as_tensor(g).view_as(p))
        self.inner.step()
        self.steps += 1
        self.release_grads()

    def release_grads(self) -> int:
        """The gradient buffers read zeros and hold no memory until the next use writes them (node.memory.release);
        returns the bytes handed back. Only between uses: after an inner update, and once an outer round is over."""
        return memory.release([p.grad for p in self.params if p.grad is not None])

    def pseudo_gradient(self) -> Sequence[torch.Tensor]:
        """anchor - the inner updates' parameters, each tensor computed when it is read (the anchor and parameters
        of that moment)."""
        return _PseudoGradient(self)

    def offer(self, compress: Optional[bool] = None) -> list[torch.Tensor]:
        """What this node hands the outer round: its pseudo-gradient, or with a sparse codec and `compress` (the node
        has peers) the top-k of pseudo-gradient plus error feedback. The same tensors until settle or carry;
        `compress` None keeps the last choice."""
        if compress is not None and compress != self._compress:
            self._compress, self._offer = compress, None
        if self._offer is None:
            if self._compress and self.feedback is not None:
                with torch.no_grad():  # tensor by tensor: the model's pseudo-gradient is never held whole
                    kept = [sparse.top_k([e + (a - q)], self.fraction)[0]
                            for e, a, q in zip(self.feedback, self.anchor, self.inner_parameters())]
                    self._offer = sparse.quantize_(kept)
            else:  # read tensor by tensor: nothing held (every reader takes it inside the round, before settle)
                self._offer = self.pseudo_gradient()
        return self._offer

    def enter_outer(self) -> None:
        if self.in_outer:
            return
        with torch.no_grad():
            self._inner = [p.detach().clone() for p in self.params]
            for a, p in zip(self.anchor, self.params):
                p.copy_(a)
        self.in_outer = True

    def set_aside(self) -> Mapping[int, torch.Tensor]:
        """id(parameter) -> the inner updates' value of it, set aside inside an outer round (where a node alone's
        passthrough outer step lands it: node.lowcomm.outer); enters the round. The mapping reads the round in
        progress and holds no tensor of its own, so the set-aside values go once the round is over."""
        self.enter_outer()
        return _SetAside(self)

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
        self.in_outer, self._offer, self._inner = False, None, None
        self.release_grads()

    def settle(self, served: Optional[Sequence[np.ndarray]] = None) -> None:
        """The parameters hold an outer update that applied this node's offer: the next anchor (views of `served`,
        the snapshot the node publishes next, when it holds their bytes). What the offer left out of the
        pseudo-gradient (and of the earlier error feedback) is the error feedback now."""
        with torch.no_grad():
            # an offer of the whole pseudo-gradient leaves zero feedback at zero ((0 + d) - d is 0 exactly): its
            # pages stay untouched
            if self.feedback is not None and (self._compress or self._feedback_written):
                offer, delta = self.offer(), self.pseudo_gradient()
                for e, d, o in zip(self.feedback, delta, offer):
                    e.add_(d).sub_(o)
                self._feedback_written = True
        self._new_anchor(served)
        self.steps, self.in_outer, self._offer, self._inner = 0, False, None, None
        self.release_grads()

    def carry(self) -> None:
        """The parameters hold the swarm's bytes without this node's pseudo-gradient (or still the anchor: nothing
        replaced them): they become the anchor and the pseudo-gradient goes back on top of them, for the next round."""
        if not self.in_outer:
            raise RuntimeError("carry() without enter_outer(): the pseudo-gradient was not set aside")
        if not self._replaced():
            self.leave_outer()
            return
        anchor = []
        with torch.no_grad():  # tensor by tensor: the pseudo-gradient is never held whole
            for p, a, q in zip(self.params, self.anchor, self._inner):
                d = a - q
                anchor.append(p.detach().clone())
                p.sub_(d)
        self.anchor, self._anchor_own = anchor, True
        self.in_outer, self._offer, self._inner = False, None, None
        self.release_grads()

    def landed(self) -> None:
        """A node alone's outer step put the parameters where its inner updates had left them (node.lowcomm.outer,
        `landing`): the set-aside copy of them goes now (P), and the gradient buffers, which that step only read,
        are released. The round then reads the parameters themselves for the inner updates' values. Nothing
        happens if any parameter differs from its set-aside value."""
        if not self.in_outer or self._inner is None:
            return
        if all(torch.equal(p.detach(), q) for p, q in zip(self.params, self._inner)):
            self._inner = [p.detach() for p in self.params]
            self.release_grads()

    def inner_parameters(self) -> list[torch.Tensor]:
        """The inner updates' parameters, wherever they are now (set aside inside an outer round)."""
        return list(self._inner) if self.in_outer else [p.detach() for p in self.params]

    def inner_parameter(self, i: int) -> torch.Tensor:
        return self._inner[i] if self.in_outer else self.params[i].detach()

    def resume(self, saved_anchor: Sequence[torch.Tensor], inner_params: Sequence[torch.Tensor],
               feedback: Optional[Sequence[torch.Tensor]], steps: int) -> None:
        """A restarted node's round as it was saved with `saved_anchor` (node.checkpoint). The anchor now is the one
        it restarted from, or the swarm's state it downloaded since: on the saved anchor the parameters become the
        saved inner updates' exactly; on another one the saved pseudo-gradient goes on top of it, as `carry` does."""
        if self.in_outer:
            raise RuntimeError("resume() inside an outer round")
        same = all(torch.equal(a, s) for a, s in zip(self.anchor, saved_anchor))
        with torch.no_grad():
            for p, a, s, q in zip(self.params, self.anchor, saved_anchor, inner_params):
                p.copy_(q) if same else p.copy_(a - (s - q))
            if feedback is not None and self.feedback is not None:
                for e, f in zip(self.feedback, feedback):
                    if f.any() or self._feedback_written:  # zeros on zeros stay untouched
                        e.copy_(f)
                        self._feedback_written = True
        self.steps, self._offer = steps, None


def _views_of(arrays: Optional[Sequence[np.ndarray]], like: Sequence[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """`arrays` (a snapshot's fp32 arrays) as tensors shaped like `like`, when they hold the same bytes; else None."""
    if arrays is None or len(arrays) != len(like):
        return None
    with warnings.catch_warnings():
        # a snapshot's arrays are read-only, and the anchor is only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        views = [torch.from_numpy(a) for a in arrays]
    if not all(v.numel() == t.numel() and v.dtype == t.dtype and torch.equal(v.view_as(t), t.detach())
               for v, t in zip(views, like)):
        return None
    return [v.view_as(t) for v, t in zip(views, like)]


class _PseudoGradient(Sequence):
    """anchor - inner parameters, one tensor at a time as it is read: the model's pseudo-gradient is never held
    whole (P). It reads the round as it is when indexed."""

    def __init__(self, rounds: "InnerRounds"):
        self._rounds = rounds

    def __len__(self) -> int:
        return len(self._rounds.params)

    def __getitem__(self, i: int) -> torch.Tensor:
        rounds = self._rounds
        with torch.no_grad():
            return rounds.anchor[i] - rounds.inner_parameter(i)


class _SetAside(Mapping):
    """InnerRounds.set_aside: id(parameter) -> its set-aside value while an outer round is in progress."""

    def __init__(self, rounds: InnerRounds):
        self._rounds = rounds
        self._index = {id(p): i for i, p in enumerate(rounds.params)}

    def __getitem__(self, key: int) -> torch.Tensor:
        inner = self._rounds._inner
        if inner is None:
            raise KeyError(key)  # no round in progress
        return inner[self._index[key]]

    def __contains__(self, key: object) -> bool:
        return self._rounds._inner is not None and key in self._index

    def __iter__(self) -> Iterator[int]:
        return iter(self._index if self._rounds._inner is not None else ())

    def __len__(self) -> int:
        return len(self._index) if self._rounds._inner is not None else 0
