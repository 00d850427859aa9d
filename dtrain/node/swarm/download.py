"""A joiner's download of a peer's state, written into the node's own tensors as it arrives.

hivemind's state averager (`DecentralizedAverager._load_state_from_peers`) receives every tensor of a peer's state
(the parameters and the optimizer's state: 3P per-step, 2P low-comm, P the fp32 parameter bytes), hands them
through a pipe to the node's process and only then copies them into the node's tensors: the whole state a second
time, for a moment, on top of the node. Here each tensor, once its chunks have arrived, is checked against the
tensor it replaces and copied into it, and goes; what is held at once is one tensor's bytes (twice: its chunks and
their join).

The wire is hivemind's, unchanged (`rpc_download_state`: the first chunk of each tensor names its dtype, the first
message carries the metadata), so a donor running hivemind's own code serves this joiner.

Nothing from a peer touches the model unchecked: the metadata's epoch is not behind the node's, its optimizer layout
is the node's, its scalars are finite; each tensor has the shape and dtype of the one it replaces, no more bytes
than that, and only finite numbers. A peer that fails a check fails its download (`BadState`) and the next peer is
asked, as hivemind does. A download that fails after it wrote some tensors leaves the node's tensors part one
state, part another (`Received.written`): the caller marks them so (`SwarmStateAverager.torn`) and the node serves
and averages none of it until a whole download replaces them (node.swarm.agreement).
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

CHUNK_SLACK_BYTES = 1 << 20  # a serialized tensor's bytes beyond its values (its header, a codec's scales)
SCALARS = (bool, int, float, str, type(None))


class UploadPace:
    """A donor's bound on the bytes it streams to downloading peers (`--serve-state-mbit`): a token bucket of
    `burst_bytes` filled at the rate, shared by every stream it paces (one event loop), so that the donor's uplink
    keeps room for its own rounds and DHT records. A rate of 0: no bound."""

    def __init__(self, mbit: float, burst_bytes: int = 1 << 20):
        if not (math.isfinite(mbit) and mbit >= 0):
            raise ValueError(f"a serving rate must be a finite number of Mbit/s >= 0, got {mbit!r}")
        self.rate = mbit * 1e6 / 8  # bytes/s
        self.burst = max(int(burst_bytes), 1)
        self._free_at = time.monotonic()  # when the bucket is full again

    def delay(self, nbytes: int, now: Optional[float] = None) -> float:
        """Seconds to wait before sending `nbytes` (counted as sent from now on)."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        start = max(self._free_at, now - self.burst / self.rate)  # a bucket holds at most `burst` bytes
        self._free_at = start + max(int(nbytes), 0) / self.rate
        return max(0.0, self._free_at - now - self.burst / self.rate)

    async def spend(self, nbytes: int) -> None:
        wait = self.delay(nbytes)
        if wait > 0:
            await asyncio.sleep(wait)


class BadState(ValueError):
    """A peer's state that does not fit this node's, or that holds a number that is not finite."""


@dataclass(frozen=True)
class Layout:
    """What a download must match: the node's optimizer state as hivemind's `dump_optimizer_state` flattens it
    (for each leaf: "tensor" with its index among the state's tensors, or "value"), and the state's tensors in the
    order they are sent: parameters, extra tensors, the optimizer's tensors."""

    optimizer: tuple[tuple[str, Optional[int]], ...]
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, flat_metadata: Sequence[dict], tensors: Sequence[torch.Tensor]) -> "Layout":
        return cls(tuple((m["type"], m.get("index")) for m in flat_metadata), tuple(t.shape for t in tensors),
                   tuple(t.dtype for t in tensors))

    def check_metadata(self, metadata: Any, min_epoch: int) -> dict:
        """The peer's metadata (hivemind's TrainingStateAverager: epoch, group_bits, optimizer_metadata)."""
        if not isinstance(metadata, dict):
            raise BadState(f"metadata is a {type(metadata).__name__}, not a dict")
        epoch = metadata.get("epoch")
        if type(epoch) is not int:
            raise BadState(f"epoch {epoch!r} is not an integer")
        if epoch < min_epoch:
            raise BadState(f"its epoch {epoch} is behind this node's {min_epoch}")
        flat = metadata.get("optimizer_metadata")
        if not isinstance(flat, list) or len(flat) != len(self.optimizer):
            raise BadState(f"its optimizer state has {len(flat) if isinstance(flat, list) else 'no'} entries, "
                           f"this node's {len(self.optimizer)}")
        for i, (entry, (kind, index)) in enumerate(zip(flat, self.optimizer)):
            if not isinstance(entry, dict) or entry.get("type") != kind or \
                    (kind == "tensor" and entry.get("index") != index):
                raise BadState(f"optimizer entry {i} is {entry!r}, this node's is a {kind}")
            value = entry.get("value")
            if kind == "value" and (not isinstance(value, SCALARS) or
                                    (isinstance(value, float) and not math.isfinite(value))):
                raise BadState(f"optimizer entry {i} is {value!r}, not a finite scalar")
        return metadata

    def check_tensor(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        if index >= len(self.shapes):
            raise BadState(f"more than the {len(self.shapes)} tensors of this node's state")
        if tensor.shape != self.shapes[index] or tensor.dtype != self.dtypes[index]:
            raise BadState(f"tensor {index}: {tuple(tensor.shape)} {tensor.dtype}, this node's is "
                           f"{tuple(self.shapes[index])} {self.dtypes[index]}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise BadState(f"tensor {index}: not every number is finite")
        return tensor

    def max_bytes(self, index: int) -> int:
        if index >= len(self.shapes):
            raise BadState(f"more than the {len(self.shapes)} tensors of this node's state")
        return self.shapes[index].numel() * self.dtypes[index].itemsize + CHUNK_SLACK_BYTES


@dataclass
class Received:
    """One peer's download: its metadata and how many of the node's tensors it wrote so far."""

    metadata: Optional[dict] = None
    written: int = 0
    chunks: list = field(default_factory=list)
    chunk_bytes: int = 0


async def receive_into(stream: AsyncIterator, layout: Layout, loads: Callable[[bytes], Any], min_epoch: int,
                       write: Callable[[int, torch.Tensor], Awaitable[None]], received: Received,
                       timeout: Optional[float] = None) -> dict:
    """Read one peer's `rpc_download_state` stream, `write` each checked tensor (its index, its values) as soon as
    it is whole, and return the peer's metadata once every tensor of `layout` is written. `received.written` counts
    the writes, also when this raises (BadState, or whatever the stream or a write raised)."""

    async def finish() -> None:
        if received.metadata is None:
            raise BadState("a tensor came before the metadata")
        index, chunks = received.written, received.chunks
        received.chunks, received.chunk_bytes = [], 0
        try:
            serialized = combine_from_streaming(chunks)
            del chunks  # held no longer than needed: a tensor's bytes are copied twice on their way (hivemind's codec)
            tensor = deserialize_torch_tensor(serialized)
            del serialized
        except Exception as e:
            raise BadState(f"tensor {index}: not a tensor ({e!r})") from None
        await write(index, layout.check_tensor(index, tensor))
        received.written += 1

    async for message in aiter_with_timeout(stream, timeout=timeout):
        if message.metadata:
            if received.metadata is not None:
                raise BadState("a second metadata")
            received.metadata = layout.check_metadata(loads(message.metadata), min_epoch)
        part = message.tensor_part
        if part.dtype and received.chunks:  # the first chunk of the next tensor: this one is whole
            await finish()
        received.chunk_bytes += len(part.buffer)
        if received.chunk_bytes > layout.max_bytes(received.written):
            raise BadState(f"tensor {received.written}: more than its {layout.max_bytes(received.written)} bytes")
        received.chunks.append(part)
    if received.chunks:
        await finish()
    if received.metadata is None:
        raise BadState("it sent no state")  # a peer that does not share its state sends nothing
    if received.written != len(layout.shapes):
        raise BadState(f"{received.written} tensors, this node's state has {len(layout.shapes)}")
    return received.metadata
