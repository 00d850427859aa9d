"""The gradient this node gathered that no update of the swarm has applied yet (training thread only).

Bridge hand-overs and the node's own batches add `sum(samples_i * g_i)` here. Before each hivemind
`Optimizer.step` call the node writes what makes hivemind's accumulator exact into `.grad` (`write_grads`).
When an update of the swarm applied this gradient it is `settle`d; when it did not (a failed or timed-out
round, an update made without this peer, a catch-up download, a peer that was behind) it simply stays and goes
into the next update as a late contribution. It is never zeroed by anything but an update that applied it, so
nothing accepted is lost and nothing is applied twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from dtrain.node import memory
from dtrain.node.contribution import Contribution, add_sections


@dataclass(frozen=True)
class Applied:
    """What one update applied of this node's gradient."""

    samples: int
    packets: int  # bridge packets among them
    local_samples: int  # samples of the node's own data
    mean_loss: float  # samples-weighted mean training loss (the API's loss history entry)


@dataclass(frozen=True)
class GradientCounters:
    pending_samples: int  # gathered, not applied yet
    pending_packets: int
    applied_samples: int  # applied by updates of the swarm, since start
    applied_packets: int
    carried_samples: int  # samples that missed at least one update and were carried into a later one
    carried_packets: int


class PendingGradient:
    def __init__(self, tensor_elements: Sequence[int]):
        # per tensor: sum(samples * grad), flat; in shared memory, since hivemind's processes fork after them
        # (node.memory)
        self._elements = list(tensor_elements)
        self._sums: Optional[list[torch.Tensor]] = [memory.shared_zeros(n) for n in self._elements]
        self._untouched = True  # the sums are fresh zeros that nothing has written yet
        self.samples = 0
        self.packets = 0
        self.local_samples = 0  # samples of the node's own data (for --local-samples-per-update)
        self._loss_sum = 0.0  # sum(samples * loss) up to the first term still on the device
        # from there on, every term in the order it came: (samples, a pass's loss tensor), or (None, samples * loss)
        self._loss_terms: list[tuple[Optional[int], torch.Tensor | float]] = []
        self._carried_samples = self._carried_packets = 0  # of the pending ones: already missed an update
        self.applied_samples = self.applied_packets = 0
        self.carried_samples = self.carried_packets = 0
        self._drained_samples = 0  # of the pending ones: already in an inner update (low-communication mode)
        self._drained_local = 0  # of the local ones: already in an inner update
        self.device = torch.device("cpu")  # where the sums are (`move_to`)

    @property
    def sums(self) -> list[torch.Tensor]:
        """Per tensor, flat: sum(samples * grad). Zeros are made when first read after a drain or settle, not
        before: a batch's gradient usually becomes the sums itself (`add(adopt=True)`)."""
        if self._sums is None:
            self._sums = [self._zeros(n) for n in self._elements]
        return self._sums

    @sums.setter
    def sums(self, tensors: list[torch.Tensor]) -> None:
        self._sums = tensors

    @property
    def loss_sum(self) -> float:
        """sum(samples * loss) of everything pending. A pass on a GPU leaves its loss there (reading it would make
        the host wait for the pass); they are read here, in one transfer, and added in the order they came."""
        if self._loss_terms:
            values = iter(torch.stack([v for n, v in self._loss_terms if n is not None]).tolist())
            for samples, value in self._loss_terms:
                self._loss_sum += value if samples is None else samples * next(values)
            self._loss_terms = []
        return self._loss_sum

    def _add_loss(self, loss_sum: float) -> None:
        if self._loss_terms:  # after a term still on the device: kept in order behind it
            self._loss_terms.append((None, loss_sum))
        else:
            self._loss_sum += loss_sum

    def move_to(self, device: torch.device) -> None:
        """The sums live on `device` from now on: where the inner loop trains (a low-comm node's resident replica,
        node.train.compute), so that a batch's gradient is added where it was computed. Only while nothing is
        pending, and after hivemind forked its processes (a GPU context is not to be inherited)."""
        if self.samples or not self._untouched:
            raise RuntimeError("move_to() with a pending gradient")
        self.device = torch.device(device)
        self._sums = None  # zeros on the device when first read

    def _zeros(self, elements: int) -> torch.Tensor:
        if self.device.type == "cpu":  # calloc: no page until written (node.memory.lazy_zeros)
            return torch.from_numpy(np.zeros(elements, np.float32))
        return torch.zeros(elements, device=self.device)

    def add(self, sums: Sequence, samples: int, loss_sum: float, packets: int = 0, local: bool = False,
            adopt: bool = False, loss: Optional[torch.Tensor] = None) -> None:
        """`adopt`: `sums` are the caller's own contiguous fp32 tensors, which it gives up. Into an empty pending
        gradient they then become the sums themselves instead of being added to zeros (P less while a local batch's
        gradient is added), with the same bytes: x + 0.0 turns a -0.0 into the 0.0 that zeros plus it makes.
        `loss`: the mean loss of a pass, as a tensor that may be on the device; then `loss_sum` is ignored and the
        sum counts `samples * loss` once it is read."""
        parts = [torch.as_tensor(part).reshape(-1) for part in sums]
        if adopt and self._untouched and all(
                part.dtype == torch.float32 and part.is_contiguous() and part.device == self.device for part in parts):
            torch._foreach_add_(parts, 0.0)  # one multi-tensor kernel on a GPU
            self.sums = parts
        else:
            torch._foreach_add_(self.sums, parts)
        self._untouched = False
        self._count(samples, loss_sum, packets, local, loss)

    def add_parts(self, parts: Iterable[tuple[int, Optional[np.ndarray], np.ndarray]], samples: int, loss_sum: float,
                  packets: int = 0) -> None:
        """Add a sparse aggregate (`robust.Aggregate.parts`): per tensor its touched elements (unique; None: all of
        them) and their values. Costs what the parts hold: untouched elements are not read."""
        self._untouched = False
        for tid, coords, values in parts:
            if self.device.type != "cpu":  # the same sums, where the inner loop trains
                acc, values = self.sums[tid], torch.from_numpy(values).to(self.device)
                if coords is None:
                    acc += values
                else:
                    acc.index_add_(0, torch.from_numpy(np.asarray(coords, np.int64)).to(self.device), values)
                continue
            acc = self.sums[tid].numpy()  # the same memory
            if coords is None:
                acc += values
            else:
                acc[coords] += values
        self._count(samples, loss_sum, packets)

    def _count(self, samples: int, loss_sum: float, packets: int, local: bool = False,
               loss: Optional[torch.Tensor] = None) -> None:
        self.samples += samples
        self.packets += packets
        if loss is not None:
            self._loss_terms.append((samples, loss.detach()))
        else:
            self._add_loss(loss_sum)
        if local:
            self.local_samples += samples

    def add_trained(self, samples: int, loss: torch.Tensor) -> None:
        """Local samples an inner update applied already (a resident inner loop's, made while an outer round ran:
        node.train.ahead), with their mean loss: pending until an outer update applies them, nothing to drain."""
        self._count(samples, 0.0, 0, local=True, loss=loss)
        self._drained_samples += samples
        self._drained_local += samples

    def add_contributions(self, contributions: Iterable[Contribution]) -> None:
        """Add each contribution weighted by its samples (validated by the bridge; sparse ones stay sparse)."""
        self._untouched = False
        views = [acc.numpy() for acc in self.sums]  # the same memory
        for c in contributions:
            add_sections(views, c.sections, float(c.samples))
            self.samples += c.samples
            self.packets += 1
            self._add_loss(c.samples * c.loss)

    def drain(self) -> list[torch.Tensor]:
        """Low-communication mode: the mean of what was added since the last drain, for one inner update; the sums
        start empty, the counts stay pending until an outer update applies them (`settle`) or misses them (`carry`)."""
        fresh = self.samples - self._drained_samples
        mean = self._take_sums()
        torch._foreach_div_(mean, max(fresh, 1))  # the sums themselves: no copy
        self._drained_samples, self._drained_local = self.samples, self.local_samples
        return mean

    def _take_sums(self) -> list[torch.Tensor]:
        """The sums as they are; the next read makes fresh zeros (that take no page until written on the CPU,
        node.memory.lazy_zeros), unless a batch's gradient becomes the sums first. So an empty pending gradient holds
        no memory (P) once the taken sums are dropped. Private memory: made after hivemind's processes forked, they
        are shared with nobody (a shared file per tensor, made and punched out at every inner update, cost a lone
        node an eighth of its time)."""
        taken, self._sums = self.sums, None
        self._untouched = True
        return taken

    @property
    def undrained_samples(self) -> int:
        return self.samples - self._drained_samples

    @property
    def undrained_local_samples(self) -> int:
        """The node's own samples since the last inner update (low-comm's allowance: --local-samples-per-update)."""
        return self.local_samples - self._drained_local

    def mean(self) -> list[torch.Tensor]:
        """The samples-weighted mean gradient (zeros when empty): this peer's update when it averages alone."""
        return [acc / max(self.samples, 1) for acc in self.sums]

    def write_grads(self, params: Sequence[torch.nn.Parameter], calls: int) -> None:
        """Write `sum * calls / samples` into the .grad buffers hivemind accumulates in.

        hivemind divides its .grad buffers by the number of step() calls of the epoch (`calls`, this one included)
        when it averages, and weighs this peer by the samples reported to it, so the swarm averages exactly
        `sum_i(S_i g_i) / sum_i(S_i)`.
        """
        scale = calls / max(self.samples, 1)
        with torch.no_grad():
            for p, acc in zip(params, self.sums):
                p.grad.copy_(acc.view_as(p)).mul_(scale)

    def settle(self) -> Applied:
        """An update of the swarm applied everything pending: count it and start empty."""
        applied = Applied(self.samples, self.packets, self.local_samples, self.loss_sum / max(self.samples, 1))
        self.applied_samples += self.samples
        self.applied_packets += self.packets
        self._sums, self._untouched = None, True
        self.samples = self.packets = self.local_samples = 0
        self._loss_sum, self._loss_terms = 0.0, []
        self._carried_samples = self._carried_packets = self._drained_samples = self._drained_local = 0
        return applied

    def carry(self) -> None:
        """An update of the swarm went by without this gradient: it goes into the next one, counted once."""
        self.carried_samples += self.samples - self._carried_samples
        self.carried_packets += self.packets - self._carried_packets
        self._carried_samples, self._carried_packets = self.samples, self.packets
        self.local_samples = self._drained_local = 0  # the node's own data: a new allowance for the next update

    def counters(self) -> GradientCounters:
        return GradientCounters(self.samples, self.packets, self.applied_samples, self.applied_packets,
                                self.carried_samples, self.carried_packets)

