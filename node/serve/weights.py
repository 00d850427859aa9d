"""Where the serving engine's weights come from: the node's published snapshot, or a fixed model (bench, tests).

The engine runs a private copy: the training thread never changes the weights under a running decode step, and
the copy is made on the serving thread, only when the served step is behind the node's and the running batch has
drained (so every completion comes from one step: the one it reports).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

from transformers import PreTrainedModel

from node.snapshot import Snapshot
from node.split.service import snapshot_state_dict


@dataclass(frozen=True)
class ServedWeights:
    model: PreTrainedModel  # private, eval mode, no gradients; never mutated once served
    step: int  # the model step these parameters are


def _frozen(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    model.requires_grad_(False)
    return model


class SnapshotWeights:
    """The node's current snapshot (`node.snapshot`), copied into a private model when asked."""

    def __init__(self, snapshot_fn: Callable[[], Snapshot], template: PreTrainedModel):
        self._snapshot_fn = snapshot_fn
        self._template = template  # shapes and tied-parameter layout; never run
        self.max_seq_len = int(template.config.max_position_embeddings)
        self.vocab_size = int(template.config.vocab_size)

    def step(self) -> int:
        return self._snapshot_fn().step

    def load(self) -> ServedWeights:
        snap = self._snapshot_fn()
        model = copy.deepcopy(self._template)
        model.load_state_dict(snapshot_state_dict(self._template, snap.f32), strict=True)
        return ServedWeights(_frozen(model), snap.step)


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
