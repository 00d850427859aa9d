"""Where the node computes (`--device`), resolved once before anything starts, and the precision it computes at.

The device runs forward and backward passes: the node's training batches and trusted reference gradients, the `/v1`
engine and split inference; in low-comm mode the whole inner loop (node.train.compute.Compute.resident). The swarm's
state does not move: the fp32 master weights and what the swarm shares stay in CPU shared memory, where hivemind's
averagers read and write them (docs/spec/NOTES.md, "Device"). On a GPU the training passes run under bf16 autocast
(where the GPU has bf16; fp32 otherwise): matrix products in bf16, weights and gradients fp32. Serving on a GPU is
fp32.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch

from dtrain.node.config import ConfigError, parse_device


@dataclass(frozen=True)
class Device:
    """A resolved `--device`."""

    torch_device: torch.device  # cpu or cuda:N
    name: str  # "cpu" or the GPU's name (torch.cuda.get_device_name)
    autocast_dtype: Optional[torch.dtype] = None  # bf16 on a GPU that has it; None: fp32 throughout

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    @property
    def precision(self) -> str:
        """How forward and backward passes compute: fp32, or bf16 autocast over fp32 weights."""
        return "bf16 autocast" if self.autocast_dtype is not None else "fp32"

    def autocast(self) -> ContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.torch_device.type, dtype=self.autocast_dtype)

    def describe(self) -> str:
        where = str(self.torch_device) if not self.is_cuda else f"{self.torch_device} ({self.name})"
        return f"{where}, {self.precision}"

    def as_dict(self) -> dict:
        return {"device": str(self.torch_device), "name": self.name, "precision": self.precision}


CPU = Device(torch.device("cpu"), "cpu")


def use_threads(threads: int) -> dict:
    """`--torch-threads`: how many threads one torch operation on the CPU may use, in every thread of this process
    (0 leaves torch's default, one per core it sees). Called once at start, before any thread runs a torch op: a
    thread takes the count at its first parallel op. Returns the counts torch has now (`threads_now`)."""
    if threads > 0:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # torch takes it once per process, before any inter-op work (a test that built a node)
            pass
    return threads_now()


def threads_now() -> dict:
    """The thread counts torch uses in this process: intra-op (one operation's threads) and inter-op."""
    return {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()}


def resolve(text: str, cuda_available: Callable[[], bool] = torch.cuda.is_available,
            cuda_count: Callable[[], int] = torch.cuda.device_count) -> Device:
    """`--device`'s value as the device to run on; ConfigError when it names a GPU this machine lacks."""
    kind, index = parse_device(text)
    if kind == "cpu" or (kind == "auto" and not cuda_available()):
        return CPU
    if not cuda_available():
        raise ConfigError(f"--device {text}: torch sees no CUDA device here (torch {torch.__version__}, built "
                          f"{'with CUDA ' + torch.version.cuda if torch.version.cuda else 'without CUDA'}); "
                          f"use --device cpu or auto")
    count = cuda_count()
    index = 0 if index is None else index
    if index >= count:
        raise ConfigError(f"--device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    device = torch.device("cuda", index)
    bf16 = torch.cuda.get_device_capability(device)[0] >= 8  # bf16 tensor cores: Ampere and later
    return Device(device, torch.cuda.get_device_name(device), torch.bfloat16 if bf16 else None)
