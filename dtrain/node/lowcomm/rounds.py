"""One node's side of a low-communication round (training thread only).

The node's parameters start each round at the `anchor` (the swarm's bytes after the last outer update) and move by
inner AdamW updates on the node's data and its browsers' packets. The pseudo-gradient is anchor minus parameters.
The outer round (`begin`) leaves the parameters where the inner updates put them: the outer step goes from the
anchor (node.lowcomm.outer, `RoundSource`) and leaves the pseudo-gradient in the parameter's `.grad`, where the
round's average was, so the round holds no copy of the parameters. A download of the swarm's state, which replaces
them, first sets them aside (`enter_outer`: a copy, and the parameters back at the anchor, as hivemind expects a
peer that downloads). After the round:
- the update applied this node's pseudo-gradient (`settle`): the new parameters are the next anchor;
- it did not (the round failed and another peer's bytes became the swarm's, or the node was behind and downloaded the
  swarm's state): `carry` takes the parameters now held as the anchor and puts the pseudo-gradient back on top of
  them, so it goes into the next round, once, with everything trained since;
- no update happened at all (`leave_outer`): the parameters are, or return to, where the inner updates left them.
Every call that may replace the parameters (an outer update, a download of the swarm's state) comes between
`begin` (or `enter_outer`) and one of the three. Nothing accepted is dropped and nothing goes into two outer updates.

The gradient buffers (`.grad`) hold something only during an outer round (the offer, then the round's average, then
the pseudo-gradient); an inner update hands AdamW its gradient as `.grad` for the step without writing the buffers.
The round writes them whole first, so in between they hold no memory (`release_grads`, node.memory.release: their
shared pages are handed back, in hivemind's averager too, which maps the same buffers).

With a sparse codec (`fraction`), what the node offers a round (`offer`) is the top-k of its pseudo-gradient plus its
error feedback (what earlier rounds did not send), its values quantized as they travel. `settle` keeps the unsent
rest, quantization error included, as the new error feedback; `carry`
and `leave_outer` leave it as it was, since the whole pseudo-gradient goes back on the parameters.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from dtrain.node import memory
from dtrain.node.lowcomm.offer import SparseOffer


class InnerRounds:
    def __init__(self, params: Sequence[torch.nn.Parameter], inner: torch.optim.Optimizer, inner_steps: int,
                 fraction: Optional[float] = None,
                 published: Optional[Callable[[], Optional[Sequence[np.ndarray]]]] = None, min_round_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, trained: Optional[Sequence[torch.Tensor]] = None,
                 before_write: Callable[[], None] = lambda: None):
        """`published`: the fp32 arrays of the snapshot the node serves now (node.snapshot), if any. The anchor is
        the served bytes in the usual case: then it reads them there instead of holding a copy of its own (P).
        `min_round_s`: the round is due once `inner_steps` are done and this long has passed since its first inner
        update (a fast device makes more inner updates, not more served steps). `trained`: the device's own copy of
        `params` (node.train.compute.Compute.resident), which `inner` steps instead: the parameters (hivemind's, on
        the CPU) take its values when a round begins and give it theirs when the round ends, and nothing else crosses
        between them; while the round runs, `step_in_round` goes on training it. `before_write`: called before the
        round writes what the inner loop's passes read (the parameters: the outer step, a download that replaces
        them; resident, the device's copy: the round's end): whatever reads them meanwhile (node.train.ahead) is done
        when it returns."""
        if inner_steps < 1:
            raise ValueError(f"inner steps must be >= 1, got {inner_steps!r}")
        if not min_round_s >= 0:
            raise ValueError(f"min_round_s must be >= 0, got {min_round_s!r}")
        self.min_round_s, self._clock = min_round_s, clock
        self.before_write = before_write
        self._first_step_at = 0.0  # when the round's first inner update was made
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction!r}")
        self.params = list(params)
        # the tensors the inner updates move: the parameters themselves, or a resident copy on the training device
        self.trained = list(trained) if trained is not None else self.params
        self._resident = trained is not None
        self._params_behind = False  # resident: inner updates moved `trained` since the parameters last took it
        # resident, inner updates made while the round runs: `trained` as the round found it, and how many
        self._round_base: Optional[list[torch.Tensor]] = None
        self._steps_in_round = 0
        self.inner = inner
        self.inner_steps = inner_steps
        self._published = published
        self.anchor: list[torch.Tensor] = []  # read only: it may be the served snapshot's bytes
        self._anchor_own = False  # the anchor is a copy of its own (it may still be shared with the snapshot)
        self._new_anchor()
        # the inner updates' parameters, set aside while a download may replace them (none in a usual round)
        self._inner: Optional[list[torch.Tensor]] = None
        # tensors the outer step moved from the anchor in this round: their pseudo-gradient is in their .grad
        self._moved: set[int] = set()
        self._applied = False  # the round's update applied the offer and its pseudo-gradient is gone (`applied`)
        self._source = RoundSource(self)
        self.steps = 0  # inner updates since the anchor (carried ones included)
        self._during_rounds = 0  # of them, made while a round ran (`step_in_round`): `due` counts the others
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
    def between_rounds(self) -> int:
        """The inner updates since the anchor made between rounds (not during one)."""
        return self.steps - self._during_rounds

    @property
    def due(self) -> bool:
        """Once --inner-steps inner updates were made between rounds (and `min_round_s` passed since the first):
        those made during the last round do not count, so the next round never begins the moment the last one ends,
        and a node behind has the time of the inner updates to catch up and join it."""
        if self.between_rounds < self.inner_steps:
            return False
        return self.min_round_s <= 0 or self._clock() - self._first_step_at >= self.min_round_s

    def inner_step(self, grads: Sequence[torch.Tensor]) -> None:
        """One AdamW update of the node's parameters with this (mean) gradient. AdamW reads `grads` themselves, as
        the parameters' `.grad` for the step only: the gradient buffers (hivemind's) are neither written nor held
        (P less than copying the gradient into them), and are the same tensors again afterwards."""
        if self.in_outer:
            raise RuntimeError("inner_step() inside an outer round")
        self.share_anchor()
        self._step_trained(grads)
        self._params_behind = self._resident
        if self.steps == self._during_rounds:  # the first between rounds
            self._first_step_at = self._clock()
        self.steps += 1

    def step_in_round(self, grads: Sequence[torch.Tensor]) -> None:
        """Resident, while the outer round runs (from the thread that trains meanwhile, node.train.ahead): one inner
        update of the device's copy, which the round does not read. It belongs to the next round: the round's end
        puts the outer step's result under the updates made meanwhile (`_trained_take_params`) and counts them in
        `steps`, not in what makes the next round `due`."""
        if not self._resident or not self.in_outer:
            raise RuntimeError("step_in_round() needs a resident inner loop inside an outer round")
        if self._round_base is None:
            with torch.no_grad():
                self._round_base = [t.detach().clone() for t in self.trained]  # P on the device, until the round ends
        self._step_trained(grads)
        self._steps_in_round += 1

    def _step_trained(self, grads: Sequence[torch.Tensor]) -> None:
        buffers = [p.grad for p in self.trained]
        try:
            for p, g in zip(self.trained, grads):
                g = torch.as_tensor(g)
                p.grad = g.view_as(p) if g.dtype == p.dtype and g.is_contiguous() else g.to(p.dtype).reshape(p.shape)
            self.inner.step()
        finally:
            for p, buffer in zip(self.trained, buffers):
                p.grad = buffer

    def _release_grad(self, i: int) -> None:
        if self.params[i].grad is not None:
            memory.release([self.params[i].grad])

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
                self._offer = SparseOffer.of(self)
            else:  # read tensor by tensor: nothing held (every reader takes it inside the round, before settle)
                self._offer = self.pseudo_gradient()
        return self._offer

    def write_offer(self, into: Sequence[torch.Tensor], scale: float, compress: Optional[bool] = None) -> None:
        """`into` (the gradient buffers) takes the offer (`offer`) times `scale`, the bits of copying it dense and
        multiplying; a sparse offer is scattered where it has values, with no dense tensor made."""
        offer = self.offer(compress)
        with torch.no_grad():
            if not isinstance(offer, SparseOffer):
                for buffer, d in zip(into, offer):
                    buffer.copy_(d).mul_(scale)
                return
            for buffer, (local, values) in zip(into, offer.carried()):
                buffer.zero_()
                buffer.view(-1)[torch.from_numpy(local)] = torch.from_numpy(values).mul_(scale)

    def payload(self) -> Optional[bytes]:
        """The sparse offer's payload, as it goes on the wire (node.lowcomm.sparse); None for a dense offer."""
        return self._offer.payload if isinstance(self._offer, SparseOffer) else None

    def begin(self) -> "RoundSource":
        """Enter the outer round with the parameters where the inner updates left them; returns what the outer step
        reads of the round (node.lowcomm.outer.OuterNesterov.source). A round in progress goes on."""
        self._params_take_trained()
        self.in_outer = True
        return self._source

    def _params_take_trained(self) -> None:
        """Resident: the parameters take the inner updates' values from the device (P across, once per round)."""
        if self._params_behind:
            _copy_all(self.params, self.trained)
            self._params_behind = False

    def _trained_take_params(self, replaced: bool = True) -> None:
        """Resident: the device's copy takes the parameters' values, where the next inner updates start. Inner
        updates made while the round ran (`step_in_round`) stay on top of them: the copy becomes the parameters plus
        what those updates moved it (nothing to add when nothing `replaced` the parameters: the copy is that
        already), and they count as the next round's."""
        if not self._resident:
            return
        base, self._round_base = self._round_base, None
        if base is None:
            _copy_all(self.trained, self.params)
            self._params_behind = False
            return
        if replaced:
            with torch.no_grad():
                for t, b, p in zip(self.trained, base, self.params):
                    t.sub_(b)
                    b.copy_(p)
                    t.add_(b)
        del base
        self.steps += self._steps_in_round
        self._during_rounds += self._steps_in_round
        self._steps_in_round = 0
        self._params_behind = True

    def enter_outer(self) -> None:
        """Before anything replaces the parameters (a download of the swarm's state, a replay of missed rounds): the
        inner updates' parameters are set aside (P) and the parameters are the anchor again. Nothing to do once they
        are aside, or once the outer step moved them (their pseudo-gradient is in .grad then)."""
        if self._inner is not None or self._moved:
            return
        self._before_params_written()
        self._params_take_trained()
        with torch.no_grad():
            self._inner = [p.detach().clone() for p in self.params]
            for a, p in zip(self.anchor, self.params):
                p.copy_(a)
        self.in_outer = True

    def holds_inner(self) -> bool:
        """In a round that nothing has moved or replaced: the parameters are the inner updates' (a node waiting for
        the round stays in it, its offer made once)."""
        return self.in_outer and self._inner is None and not self._moved

    def _replaced(self) -> bool:
        return any(not torch.equal(p.detach(), a) for a, p in zip(self.anchor, self.params))

    def leave_outer(self) -> None:
        """No outer update happened: back to the inner updates' parameters, exactly (set aside: copied back; else
        they never left). Should the outer step have moved them all the same, the pseudo-gradient goes back on top
        of them (`carry`)."""
        if not self.in_outer:
            return
        if self._moved:
            self.carry()
            return
        if self._inner is not None:
            with torch.no_grad():
                for p, q in zip(self.params, self._inner):
                    p.copy_(q)
        self._end_round(replaced=False)

    def _end_round(self, replaced: bool = True) -> None:
        if self._resident:
            self.before_write()  # the passes on the device's copy end inside the round, before it writes the copy
        self.in_outer, self._offer, self._inner = False, None, None
        self._moved, self._applied = set(), False
        self.release_grads()
        self._trained_take_params(replaced)

    def _before_params_written(self) -> None:
        """The passes read the parameters, unless the inner loop is resident: they read the device's copy then."""
        if not self._resident:
            self.before_write()

    def settle(self, served: Optional[Sequence[np.ndarray]] = None) -> None:
        """The parameters hold an outer update that applied this node's offer: the next anchor (views of `served`,
        the snapshot the node publishes next, when it holds their bytes). What the offer left out of the
        pseudo-gradient (and of the earlier error feedback) is the error feedback now (`applied`, if not called
        yet)."""
        self.applied()
        self._new_anchor(served)
        self.steps = self._during_rounds = 0
        self._end_round()

    def applied(self) -> None:
        """The first half of `settle`, for a node that makes the update's snapshot in between: the error feedback
        takes what the offer left out, and the round's `.grad` (the pseudo-gradient) and offer go, before the
        snapshot is made (P and more less at the update's peak). Only `settle` may follow."""
        if self._applied:
            return
        with torch.no_grad():
            # an offer of the whole pseudo-gradient leaves zero feedback at zero ((0 + d) - d is 0 exactly): its
            # pages stay untouched
            if self.feedback is not None and (self._compress or self._feedback_written):
                offer, delta = self.offer(), self.pseudo_gradient()
                # a sparse offer is subtracted where it has values, with the bits of subtracting it dense
                sent = offer.carried() if isinstance(offer, SparseOffer) else offer
                for i, (e, d, o) in enumerate(zip(self.feedback, delta, sent)):
                    e.add_(d)
                    if isinstance(o, torch.Tensor):
                        e.sub_(o)
                    else:
                        local, values = (torch.from_numpy(a) for a in o)
                        flat = e.view(-1)
                        flat[local] = flat[local] - values
                    # its pseudo-gradient is read: that .grad's pages go as the feedback's are written (the first
                    # sparse round writes all of it: P), not after the whole model
                    self._release_grad(i)
                self._feedback_written = True
        self._applied, self._offer = True, None
        self.release_grads()

    def carry(self) -> None:
        """The parameters hold the swarm's bytes without this node's pseudo-gradient (or still the anchor: nothing
        replaced them): they become the anchor and the pseudo-gradient goes back on top of them, for the next round."""
        if not self.in_outer:
            raise RuntimeError("carry() outside an outer round")
        if self._applied:
            raise RuntimeError("carry() after applied(): the round's pseudo-gradient is gone")
        if (self._inner is None and not self._moved) or (self._inner is not None and not self._replaced()):
            self.leave_outer()  # nothing replaced the parameters: they are the inner updates' (or return there)
            return
        anchor, delta = [], self.pseudo_gradient()
        with torch.no_grad():  # tensor by tensor: the pseudo-gradient is never held whole
            for i, (p, a) in enumerate(zip(self.params, self.anchor)):
                if self._inner is None and i not in self._moved:
                    anchor.append(a)  # the outer step did not reach it: it still holds the inner updates' value
                    continue
                d = delta[i]
                anchor.append(p.detach().clone())
                p.sub_(d)
                self._release_grad(i)  # read: its pages go as the new anchor's are written
        self.anchor, self._anchor_own = anchor, True
        self._end_round()

    def landed(self) -> None:
        """A node alone's outer step left the parameters where its inner updates had put them (node.lowcomm.outer,
        passthrough): the gradient buffers, which that step only read, are released before the update's snapshot
        is made, and a set-aside copy of the parameters goes too (P), the round then reading the parameters
        themselves for the inner updates' values. Nothing happens if any parameter differs from its set-aside
        value."""
        if not self.in_outer or self._moved:
            return
        if self._inner is None:
            self.release_grads()
            return
        if all(torch.equal(p.detach(), q) for p, q in zip(self.params, self._inner)):
            self._inner = None
            self.release_grads()

    def inner_parameters(self) -> list[torch.Tensor]:
        """The inner updates' parameters, wherever they are now (set aside while a download may replace them)."""
        return [self.inner_parameter(i) for i in range(len(self.params))]

    def inner_parameter(self, i: int) -> torch.Tensor:
        if self._inner is not None:
            return self._inner[i]
        if i in self._moved:
            raise RuntimeError("the outer step moved this parameter: its pseudo-gradient is in .grad, the inner "
                               "updates' value is gone")
        if self._params_behind:  # between rounds, resident: on the device (a checkpoint's copy)
            return self.trained[i].detach().cpu()
        return self.params[i].detach()

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
        self.steps, self._during_rounds, self._offer = steps, 0, None
        self._trained_take_params()


def _copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)


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
    whole (P). It reads the round as it is when indexed: once the outer step moved a tensor, the bits of it that
    step left in its .grad."""

    def __init__(self, rounds: "InnerRounds"):
        self._rounds = rounds

    def __len__(self) -> int:
        return len(self._rounds.params)

    def __getitem__(self, i: int) -> torch.Tensor:
        rounds = self._rounds
        if i in rounds._moved:
            return rounds.params[i].grad.detach()
        with torch.no_grad():
            return rounds.anchor[i] - rounds.inner_parameter(i)


class RoundSource:
    """What the outer step reads of the round in progress, parameter by parameter (node.lowcomm.outer): where the
    parameter starts from, and what a node alone lands it on. It reads the round as it is when asked, and holds no
    tensor of its own."""

    def __init__(self, rounds: InnerRounds):
        self._rounds = rounds
        self._index = {id(p): i for i, p in enumerate(rounds.params)}

    def anchor(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The round's start for `p` while `p` still holds the inner updates' value (the step goes from there);
        None when `p` holds the value to step itself (a download replaced it, or the round is over)."""
        rounds, i = self._rounds, self._index.get(id(p))
        rounds._before_params_written()  # the outer step writes `p` next
        if i is None or not rounds.in_outer or rounds._inner is not None or i in rounds._moved:
            return None
        return rounds.anchor[i]

    def inner(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The inner updates' value of `p` when it is set aside, else None."""
        rounds, i = self._rounds, self._index.get(id(p))
        rounds._before_params_written()  # the outer step writes `p` next
        if i is None or not rounds.in_outer or rounds._inner is None:
            return None
        return rounds._inner[i]

    def moved(self, p: torch.Tensor) -> None:
        """The outer step moved `p` from `anchor(p)` and left its pseudo-gradient (anchor - inner value) in p.grad."""
        self._rounds._moved.add(self._index[id(p)])
