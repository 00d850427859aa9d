"""Models that read one published step's weights, built on the snapshot's own fp32 bytes.

A snapshot (node.snapshot) is never mutated once published, and its fp32 copy is one buffer in the layout of
`model.parameters()`. A model whose parameters are views of that buffer reads the step's weights with no copy of
its own: building one from the `meta` template allocates no parameter memory, only modules. The engines that read a
step's weights (the `/v1` engine, split inference, feedback and adapter scoring) share one such model per snapshot
(`SnapshotModels`); it exists once an engine asked for it, and the snapshot's bytes are freed once the node published
a newer one and no engine holds the older model any more.
"""
from __future__ import annotations

import copy
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from dtrain.node.snapshot import Snapshot


def on_snapshot(template: torch.nn.Module, f32: Sequence[np.ndarray], trainable: bool = False) -> torch.nn.Module:
    """A model of `template`'s shapes whose parameters are views of `f32` (flat float32 arrays in
    `named_parameters()` order, tied weights once), in eval mode.

    Nothing may write to its parameters: they are the snapshot's bytes. `trainable` only makes them leaves that
    autograd differentiates (torch.autograd.grad, no .grad buffers written by the caller).
    """
    model = copy.deepcopy(template)  # on `meta`: modules only
    params = list(model.named_parameters())
    if len(params) != len(f32):
        raise ValueError(f"snapshot has {len(f32)} tensors; the model has {len(params)} parameters")
    with warnings.catch_warnings():
        # the snapshot's arrays are read-only views, and these parameters are only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        for (name, p), flat in zip(params, f32):
            if flat.size != p.numel() or flat.dtype != np.float32:
                raise ValueError(f"snapshot tensor {name}: {flat.size} {flat.dtype} elements, want {p.numel()} "
                                 f"float32")
            owner, _, attr = name.rpartition(".")
            view = torch.from_numpy(flat).view(p.shape)
            model.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(view, requires_grad=trainable)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # the LM head reads the embedding's parameter again
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"the template has tensors no snapshot fills: {left[:4]}")
    model.eval()
    return model


@dataclass(frozen=True)
class StepModel:
    model: torch.nn.Module  # parameters are the snapshot's bytes: never mutated, no gradients
    step: int  # the model step these parameters are


class SnapshotModels:
    """One frozen model per published snapshot, shared by every engine that reads a step's weights.

    `current()` builds it on first use (any thread; a few milliseconds, no parameter copy). `published(snap)`, a
    snapshot listener of the node, drops the older step's model, so the node holds no model of an older snapshot
    unless an engine is still using it.
    """

    def __init__(self, snapshot_fn: Callable[[], Snapshot], template: torch.nn.Module):
        self._snapshot_fn = snapshot_fn
        self._template = template  # on `meta`: shapes and tied-parameter layout; never run
        self.max_seq_len = int(template.config.max_position_embeddings)
        self.vocab_size = int(template.config.vocab_size)
        self.hidden_size = int(template.config.hidden_size)
        self._lock = threading.Lock()  # guards _cached
        self._cached: dict[torch.device, tuple[Snapshot, StepModel]] = {}  # per device: its snapshot and model

    @classmethod
    def following(cls, node, template: torch.nn.Module) -> "SnapshotModels":
        """The shared models of a started TrainingNode's snapshots, dropped as the node publishes newer ones."""
        models = cls(node.snapshot, template)
        node.add_snapshot_listener(models.published)
        return models

    def step(self) -> int:
        return self._snapshot_fn().step

    def current(self, device: torch.device = torch.device("cpu")) -> StepModel:
        """The frozen model of the node's current snapshot, on `device` (the CPU one reads the snapshot's bytes; on
        an accelerator, one copy there per snapshot, shared too)."""
        snap, device = self._snapshot_fn(), torch.device(device)
        with self._lock:
            cached = self._cached.get(device)
            if cached is None or cached[0] is not snap:
                model = on_snapshot(self._template, snap.f32)
                if device.type != "cpu":
                    model.to(device)  # this module's own parameters move; the snapshot's bytes stay as they are
                cached = self._cached[device] = (snap, StepModel(model, snap.step))
            return cached[1]

    def trainable(self) -> tuple[Snapshot, torch.nn.Module]:
        """The current snapshot and a model of it of its own whose parameters autograd differentiates (feedback
        scoring); its parameters are the snapshot's bytes too."""
        snap = self._snapshot_fn()
        return snap, on_snapshot(self._template, snap.f32, trainable=True)

    def published(self, snap: Snapshot) -> None:
        with self._lock:
            self._cached = {device: c for device, c in self._cached.items() if c[0] is snap}
