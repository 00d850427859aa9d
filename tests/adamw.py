"""The reference AdamW the tests predict a node's update with: torch's, with GPT-2's weight-decay grouping read off
the manifest's shapes (tensors of 2 or more dimensions decay, biases and LayerNorm weights do not)."""
from __future__ import annotations

from typing import Sequence

import torch


def gpt2_adamw(params: Sequence[torch.nn.Parameter], shapes: Sequence[Sequence[int]], lr: float, betas, eps: float,
               weight_decay: float) -> torch.optim.AdamW:
    """`params` are flat (as downloaded); `shapes` the manifest's, in the same order."""
    assert len(params) == len(shapes)
    decay = [p for p, shape in zip(params, shapes) if len(shape) >= 2]
    plain = [p for p, shape in zip(params, shapes) if len(shape) < 2]
    assert decay and plain, "a GPT-2 has both matrices and vectors"
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(betas), eps=eps)
