"""The trusted reference direction: the node's own gradient on a small batch of its own data (FLTrust, Cao et al.
2021).

Contributors are strangers, and any statistic of what they send is written by them: a weight majority writes the
Adam momentum as much as the mean. The node's own gradient, at the model it serves, on text it holds (`--train-data`,
else the packaged corpus), is one direction no contributor can write. `robust.aggregate` judges each contribution
against it: a contribution whose cosine with it is not positive counts 0 (FLTrust's ReLU(cosine)), and its L2 norm is
bounded by the reference's. An honest gradient of the same model on text like the node's points the same way (positive
cosine) and is smaller than a dense gradient, so for honest contributors both are no-ops and the hand-over is still the
exact samples-weighted mean (NOTES.md).

One reference per model step (every hand-over of a step is judged against the same one), on `batch_size` sequences
drawn afresh each step; its cost is one forward and backward pass of that batch (docs/robustness.md measures it).
Training thread only: it reads the model the thread steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from dtrain.node.data import TokenDataset
from dtrain.node.train.compute import Compute


class ReferenceConfigError(ValueError):
    """A reference option out of range; the message names it."""


@dataclass(frozen=True)
class ReferenceConfig:
    batch_size: int = 4  # sequences of the node's own data per reference (0: no reference)
    seq_len: int = 64  # tokens per sequence (bounded by the model's max_seq_len)

    def __post_init__(self):
        if self.batch_size < 0 or self.batch_size > 256:
            raise ReferenceConfigError(f"reference batch size must be in [0, 256], got {self.batch_size}")
        if self.seq_len < 2:
            raise ReferenceConfigError(f"reference sequence length must be >= 2, got {self.seq_len}")


@dataclass(frozen=True)
class Reference:
    """The node's own mean gradient at one step."""

    step: int
    gradient: tuple[np.ndarray, ...]  # flat float32 per tensor, in the model's parameter order
    norm: float  # its L2 norm over all tensors (float64)
    loss: float  # the node's training loss on the batch it was computed on
    seconds: float  # wall time of the forward and backward pass


def compute(model: torch.nn.Module | Compute, tokens: np.ndarray, step: int) -> Reference:
    """The mean gradient of `model`'s loss on `tokens` ([batch, seq_len] token ids), on the device of its Compute
    (a bare module: the CPU); touches no .grad buffer."""
    started = time.perf_counter()
    runner = model if isinstance(model, Compute) else Compute(model)
    params = list(runner.master.parameters())
    loss, grads = runner.loss_and_grads(tokens, allow_unused=True)  # .grad belongs to the optimizer
    # copies: a GPU pass's gradients are views of a buffer its next pass overwrites, and a reference lasts a step
    flat = tuple(np.array((torch.zeros(p.numel()) if g is None else g.detach().reshape(-1).cpu()).numpy(),
                          dtype=np.float32) for g, p in zip(grads, params))
    norm = float(np.sqrt(sum(float(np.dot(g.astype(np.float64), g)) for g in flat)))
    return Reference(step, flat, norm, float(loss.item()), time.perf_counter() - started)


class ReferenceSource:
    """One reference per model step, on a fresh batch of the node's own data each step."""

    def __init__(self, model: torch.nn.Module | Compute, dataset: TokenDataset, config: ReferenceConfig, max_seq_len: int,
                 seed: int = 0):
        self.model, self.dataset, self.config = model, dataset, config
        self.seq_len = min(config.seq_len, max_seq_len)
        self._rng = np.random.default_rng(seed)
        self._current: Optional[Reference] = None
        self.computed = 0  # references computed since start
        self.seconds = 0.0  # their total wall time

    def at(self, step: int) -> Optional[Reference]:
        """The reference for the model at `step` (computed on the first call of each step); None if it is not
        finite (a node whose own model is broken judges nothing by it)."""
        if self._current is None or self._current.step != step:
            tokens = self.dataset.batch(self.config.batch_size, self.seq_len, self._rng)
            ref = compute(self.model, tokens, step)
            self.computed += 1
            self.seconds += ref.seconds
            self._current = ref if np.isfinite(ref.norm) and ref.norm > 0 else None
            if self._current is None:
                return None
        return self._current
