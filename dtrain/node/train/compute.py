"""Forward and backward passes of the node's model on its device (`--device`), gradients back on the CPU.

The model the training thread steps is the master copy: fp32, in CPU shared memory, the tensors hivemind's averagers
and the optimizer own (docs/spec/NOTES.md, "Device"). On the CPU a pass runs on it directly, exactly as it always
did. On a GPU a replica of it runs the pass under bf16 autocast: before each pass the replica takes the master's
current parameters (every inner update changes them), and the gradient comes back as fp32 CPU tensors, which is what
the pending sum, the robust aggregation and hivemind's accumulators add to. Training thread only.
"""
from __future__ import annotations

import copy
from typing import Optional, Sequence

import numpy as np
import torch

from dtrain.node.device import CPU, Device


class Compute:
    def __init__(self, master: torch.nn.Module, device: Device = CPU):
        self.master, self.device = master, device
        self._params = list(master.parameters())
        # made at the first pass, not here: hivemind forks its processes at start, from a process that should not
        # hold a CUDA context yet
        self._replica: Optional[torch.nn.Module] = None
        self._replica_params: list[torch.Tensor] = []

    @property
    def owns_grads(self) -> bool:
        """Whether the gradients `loss_and_grads` returns are new tensors the caller may keep (CPU), rather than
        views of a buffer the next call overwrites (GPU)."""
        return not self.device.is_cuda

    def loss_and_grads(self, tokens: np.ndarray, scale: int = 1, allow_unused: bool = False
                       ) -> tuple[torch.Tensor, Sequence[Optional[torch.Tensor]]]:
        """The mean LM loss on `tokens` [batch, seq_len] and `scale` times its gradient per parameter of the master
        (in its `parameters()` order), both on the CPU, fp32; no `.grad` buffer is touched (they belong to hivemind).

        On the CPU the gradients are the caller's own tensors (`owns_grads`); on a GPU they are views of one pinned
        buffer that the next call overwrites: add them somewhere or copy them before then."""
        if not self.device.is_cuda:
            x = torch.from_numpy(tokens.astype(np.int64))
            loss = self.master(input_ids=x, labels=x).loss
            grads = torch.autograd.grad(loss, self._params, allow_unused=allow_unused)
            if scale != 1:  # in place: autograd's outputs are this call's own tensors (P less than a scaled copy)
                for g in grads:
                    if g is not None:
                        g.mul_(scale)
            return loss, grads
        self._sync()
        x = torch.from_numpy(tokens.astype(np.int64)).to(self.device.torch_device)
        with self.device.autocast():
            loss = self._replica(input_ids=x, labels=x).loss
        grads = torch.autograd.grad(loss, self._replica_params, allow_unused=allow_unused)
        with torch.no_grad():
            flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).float()
                              for g, p in zip(grads, self._replica_params)])
            if scale != 1:
                flat.mul_(scale)  # the same fp32 products the CPU would make, without a CPU pass over them
            self._out.copy_(flat)  # one transfer into pinned memory: no page faults, DMA speed
        return loss.detach().float().cpu(), self._out_views

    def _sync(self) -> None:
        if self._replica is None:
            self._replica = copy.deepcopy(self.master).to(self.device.torch_device)  # tied weights stay tied
            self._replica_params = list(self._replica.parameters())
            self._out = torch.empty(sum(p.numel() for p in self._params), pin_memory=True)
            self._out_views = [part.view_as(p) for part, p in
                               zip(self._out.split([p.numel() for p in self._params]), self._params)]
        with torch.no_grad():
            for replica, master in zip(self._replica_params, self._params):
                replica.copy_(master)
