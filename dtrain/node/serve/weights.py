"""Where the serving engine's weights come from: the node's published snapshot, or a fixed model (bench, tests).

The engine runs a frozen model the training thread never changes: the node's shared model of a published snapshot
(node.frozen), whose parameters are the snapshot's own bytes. The engine takes it on the serving thread, only when
a request waits and the running batch has drained (so every completion comes from one step: the one it reports).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from dtrain.node.frozen import SnapshotModels


def load_snapshot(model: torch.nn.Module, f32: tuple[np.ndarray, ...]) -> torch.nn.Module:
    """Copy a snapshot's flat float32 arrays (`named_parameters()` order, tied weights once) into `model`."""
    params = list(model.parameters())
    if len(params) != len(f32):
        raise ValueError(f"snapshot has {len(f32)} tensors; the model has {len(params)} parameters")
    with torch.no_grad():
        for p, flat in zip(params, f32):
            if flat.size != p.numel():
                raise ValueError(f"snapshot tensor of {flat.size} elements for a parameter of {p.numel()}")
            # torch.tensor copies: the snapshot's arrays are read-only, and torch warns on wrapping those
            p.copy_(torch.tensor(flat).view_as(p))
    return model


@dataclass(frozen=True)
class ServedWeights:
    model: PreTrainedModel  # eval mode, no gradients; never mutated once served
    step: int  # the model step these parameters are


def _frozen(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    model.requires_grad_(False)
    return model


class SnapshotWeights:
    """The node's shared frozen model of its current snapshot (node.frozen.SnapshotModels)."""

    def __init__(self, models: SnapshotModels, device: torch.device = torch.device("cpu")):
        self._models = models
        self._device = torch.device(device)  # the engine's
        self.max_seq_len = models.max_seq_len
        self.vocab_size = models.vocab_size

    def step(self) -> int:
        return self._models.step()

    def load(self) -> ServedWeights:
        current = self._models.current(self._device)
        return ServedWeights(current.model, current.step)


class FixedWeights:
    """One model at one step, for benchmarks and tests (a copy: the caller's model stays its own)."""

    def __init__(self, model: PreTrainedModel, step: int = 0):
        self._served = ServedWeights(_frozen(copy.deepcopy(model)), int(step))
        self.max_seq_len = int(model.config.max_position_embeddings)
        self.vocab_size = int(model.config.vocab_size)

    def step(self) -> int:
        return self._served.step

    def load(self) -> ServedWeights:
        return self._served
