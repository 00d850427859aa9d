"""Forward and backward passes of the node's model on its device (`--device`).

The model hivemind shares is the master: fp32, in CPU shared memory (docs/spec/NOTES.md, "Device"). Where the
passes run depends on who owns the parameters being trained:
- on the CPU, a pass runs on the master itself;
- `resident()`: a replica on the device is the inner loop's own model (low-comm, node.lowcomm.rounds: the inner
  updates move the replica, and the master only takes its values at an outer round). A pass runs on the replica
  under bf16 autocast where the device has it, and the gradients stay on the device: nothing crosses per batch;
- otherwise on a GPU (per-step mode, whose every update is the swarm's, on the master): before each pass the replica
  takes the master's parameters, and the gradients come back as fp32 CPU tensors.
Training thread only, or the thread that trains while the training thread waits for a round (node.train.ahead).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

import numpy as np
import torch

from dtrain.node.device import CPU, Device

if TYPE_CHECKING:
    from dtrain.node.data import TokenDataset


class Batch(NamedTuple):
    """One or more local batches' gradient: what the pending gradient takes (node.train.gradient)."""

    sums: Sequence[torch.Tensor]  # per parameter: the sum over its samples of each sample's gradient, fp32
    samples: int
    loss: torch.Tensor  # the mean loss over the samples (a 0-dim tensor, where the passes ran)


class Compute:
    def __init__(self, master: torch.nn.Module, device: Device = CPU):
        self.master, self.device = master, device
        self._params = list(master.parameters())
        # made at the first pass (or `resident`), not here: hivemind forks its processes at start, from a process
        # that should not hold a CUDA context yet
        self._replica: Optional[torch.nn.Module] = None
        self._replica_params: list[torch.Tensor] = []
        self._resident = False

    def resident(self) -> torch.nn.Module:
        """The device's own copy of the model, made now from the master's parameters: from here on every pass runs on
        it as it is and returns its gradients on the device. Returns it; its parameters (in the master's order) are
        the caller's to train, and the passes read the master no more."""
        self._resident = True
        self._make_replica()
        with torch.no_grad():
            for replica, master in zip(self._replica_params, self._params):
                replica.copy_(master)
        return self._replica

    @property
    def owns_grads(self) -> bool:
        """Whether the gradients `loss_and_grads` returns are new tensors the caller may keep (on the CPU, or on the
        device of a resident replica), rather than views of a buffer the next call overwrites."""
        return self._resident or not self.device.is_cuda

    @property
    def grads_device(self) -> torch.device:
        """Where the gradients `loss_and_grads` returns are."""
        return self.device.torch_device if self._resident else torch.device("cpu")

    def loss_and_grads(self, tokens: np.ndarray, scale: int = 1, allow_unused: bool = False
                       ) -> tuple[torch.Tensor, Sequence[Optional[torch.Tensor]]]:
        """The mean LM loss on `tokens` [batch, seq_len] and `scale` times its gradient per parameter (in
        `parameters()` order), fp32, on `grads_device`; no `.grad` buffer is touched (they belong to hivemind).

        The gradients are the caller's own tensors where `owns_grads`; else (a GPU pass for the master) they are views
        of one pinned buffer that the next call overwrites: add them somewhere or copy them before then."""
        if not self.device.is_cuda and not self._resident:
            x = torch.from_numpy(tokens.astype(np.int64))
            loss = self.master(input_ids=x, labels=x).loss
            return loss, _scaled(torch.autograd.grad(loss, self._params, allow_unused=allow_unused), scale)
        if not self._resident:
            self._sync()
        x = torch.from_numpy(tokens.astype(np.int64))
        if self.device.is_cuda:  # from pinned memory, queued behind the last pass: the host does not wait for it
            x = x.pin_memory().to(self.device.torch_device, non_blocking=True)
        else:
            x = x.to(self.device.torch_device)
        with self.device.autocast():
            loss = self._replica(input_ids=x, labels=x).loss
        grads = torch.autograd.grad(loss, self._replica_params, allow_unused=allow_unused)
        if self._resident:  # fp32 already (autocast keeps the weights' dtype for their gradients); the loss stays
            return loss.detach().float(), _scaled(grads, scale)  # on the device: reading it waits for the pass
        with torch.no_grad():
            flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).float()
                              for g, p in zip(grads, self._replica_params)])
            if scale != 1:
                flat.mul_(scale)  # the same fp32 products the CPU would make, without a CPU pass over them
            self._out.copy_(flat)  # one transfer into pinned memory: no page faults, DMA speed
        return loss.detach().float().cpu(), self._out_views

    def _make_replica(self) -> None:
        if self._replica is not None:
            return
        self._replica = copy.deepcopy(self.master).to(self.device.torch_device)  # tied weights stay tied
        self._replica_params = list(self._replica.parameters())
        if self.device.is_cuda and not self._resident:
            self._out = torch.empty(sum(p.numel() for p in self._params), pin_memory=True)
            self._out_views = [part.view_as(p) for part, p in
                               zip(self._out.split([p.numel() for p in self._params]), self._params)]

    def _sync(self) -> None:
        self._make_replica()
        with torch.no_grad():
            for replica, master in zip(self._replica_params, self._params):
                replica.copy_(master)


class OwnBatches:
    """The node's own data (--train-data), batch by batch: the next [batch_size, seq_len] windows, drawn with the
    node's generator, and their gradient summed over the batch."""

    def __init__(self, compute: Compute, dataset: "TokenDataset", batch_size: int, seq_len: int,
                 rng: np.random.Generator):
        self._compute, self._dataset, self._rng = compute, dataset, rng
        self._shape = (batch_size, seq_len)

    def next(self) -> Batch:
        tokens = self._dataset.batch(*self._shape, self._rng)
        batch = tokens.shape[0]
        # autograd.grad, not backward(): the .grad buffers belong to hivemind (reuse_grad_buffers)
        loss, sums = self._compute.loss_and_grads(tokens, scale=batch)  # sum over the batch of each sample's gradient
        return Batch(sums, batch, loss)


def _scaled(grads: Sequence[Optional[torch.Tensor]], scale: int) -> Sequence[Optional[torch.Tensor]]:
    """In place: autograd's outputs are this call's own tensors (P less than a scaled copy). One multi-tensor kernel
    on a GPU instead of a launch per tensor; the same products as `mul_`."""
    if scale != 1:
        torch._foreach_mul_([g for g in grads if g is not None], scale)
    return grads
