"""The swarm's state as a node holds and hands it out: the training tensors kept in shared memory where hivemind's
processes use them in place (`keep_state_shared`), and the state averager that averages them, answers a joiner's
download with one moment's state (`SwarmStateAverager`; in low-comm mode the served epoch's, `ServedState`) and
downloads a peer's state into them as it arrives (node.swarm.download)."""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from itertools import chain
from typing import AsyncIterator, Optional, Sequence

import torch
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state, load_optimizer_state
from hivemind.compression import CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.streaming import split_for_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from dtrain.node import memory
from dtrain.node.swarm.download import BadState, Layout, Received, UploadPace, receive_into
from dtrain.node.swarm.deadlines import Retimable
from dtrain.node.swarm.keygate import KeyGatedServicer

logger = get_logger(__name__)


def keep_state_shared(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Keep `optimizer`'s parameters, their gradient buffers and every CPU tensor of its state in shared memory: the
    parameters and gradient buffers now, the state now, after each step and after each load. A load copies the
    loaded values into the state tensors there were before it, so they stay the tensors hivemind's state averager
    averages in place (`reuse_tensors`).

    Called before hivemind forks its processes: what the node holds privately at a fork, each child keeps a copy of
    once the node writes it (node.memory).

    hivemind hands a peer that downloads this node's state the parameters and the optimizer's state tensors through
    a multiprocessing pipe, after it let go of its lock (with an optimizer given to it, hivemind averages copies and
    leaves the model's own tensors where they are). Pickling a tensor that is not yet in shared memory moves its
    storage there and frees the old memory, while the training thread may be reading or writing it (a forward pass,
    the next optimizer step, a snapshot): a read of freed memory, which for large tensors is unmapped and crashes the
    node (SIGSEGV in libtorch), and for small ones (AdamW's `step`) silently corrupts them. Tensors already in shared
    memory are pickled as they are: nothing moves.
    """
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.device.type == "cpu" and not p.is_shared():
                    p.share_memory_()
                if p.grad is None and p.device.type == "cpu":  # hivemind accumulates in them (reuse_grad_buffers)
                    p.grad = memory.shared_zeros(p.numel()).view_as(p)

    def share(*_) -> None:
        memory.share(value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value))

    before_load: dict[int, dict] = {}

    def remember(opt, _state_dict) -> None:
        before_load.clear()
        before_load.update({id(p): dict(opt.state[p]) for p in opt.state})

    def restore(opt) -> None:
        with torch.no_grad():
            for p, state in opt.state.items():
                for key, loaded in list(state.items()):
                    kept = before_load.get(id(p), {}).get(key)
                    if torch.is_tensor(loaded) and torch.is_tensor(kept) and kept.shape == loaded.shape and \
                            kept.dtype == loaded.dtype and kept.device == loaded.device:
                        kept.copy_(loaded)
                        state[key] = kept
        before_load.clear()
        share()

    share()
    optimizer.register_step_post_hook(share)
    optimizer.register_load_state_dict_pre_hook(remember)
    optimizer.register_load_state_dict_post_hook(restore)
    return optimizer


SERVED_WAIT_S = 5.0  # how long a download request waits for the outer step's state to settle into a published one


class StateNotServed(RuntimeError):
    """The node cannot hand out one epoch's state right now (an outer step or a download is writing it)."""


@dataclass(frozen=True)
class ServedState:
    """Low-comm: the state this node hands a downloading peer, which is the swarm's at `epoch`: the parameters of the
    snapshot it serves (the round's anchor; never the inner updates' parameters) and the outer optimizer's state as
    it was at outer-optimizer `version` (OuterNesterov.version)."""

    epoch: int
    params: Sequence  # flat float32 arrays in the order of the model's parameters (Snapshot.f32)
    version: int


@dataclass(frozen=True)
class Downloaded:
    """What the averager's process tells the node of a download it wrote into the node's tensors."""

    metadata: Optional[dict]  # the peer's (epoch, optimizer metadata) when a whole state was written, else None
    torn: bool  # a download that failed part-way wrote some of the tensors


class Abandoned(RuntimeError):
    """The node stopped waiting for the download: nothing more is written."""


class SwarmStateAverager(Retimable, KeyGatedServicer, TrainingStateAverager):
    """hivemind's state averager (parameter and state averaging, state downloads) whose RPCs, in a closed swarm,
    answer only peers that prove the key (node.swarm.keygate), whose downloads are one moment's state, and which
    downloads a peer's state into the node's tensors as it arrives (`load_state_from_peers`)."""

    # Mbit/s a donor streams its state at, at most (--serve-state-mbit; 0: no bound), read when an averager is made:
    # the node sets it before it joins (hivemind makes the averager inside its optimizer)
    serve_mbit: float = 0.0

    def __init__(self, *args, **kwargs):
        # the parameters and optimizer state are the averaged tensors themselves (they are in shared memory already,
        # node.swarm.state.keep_state_shared): no second copy of them (up to 3P). An all-reduce then writes the
        # training tensors: it holds lock_averaged_tensors while it does, and `step` waits for it to let go
        self.served: Optional[ServedState] = None
        self.torn = False  # the tensors hold part of a download that failed: serve and average none of it
        self._downloading = False  # a download is being written into the tensors (set and read under the lock)
        self._stream: Optional[tuple[Layout, tuple[torch.Tensor, ...]]] = None  # set when the process starts
        # the bound on the state this donor streams (its process forks in the constructor, with this)
        self._pace = UploadPace(SwarmStateAverager.serve_mbit)
        super().__init__(*args, reuse_tensors=True, **kwargs)

    def _state_tensors(self) -> tuple[list, tuple[torch.Tensor, ...]]:
        """The optimizer's flat metadata, and the tensors a download writes in the order a peer sends them
        (TrainingStateAverager.get_current_state): parameters, extra tensors, the optimizer's state."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        flat_metadata, optimizer_tensors = dump_optimizer_state(self.optimizer)
        return flat_metadata, tuple(chain(params, self.extra_tensors, optimizer_tensors))

    def run_in_background(self, *args, **kwargs):
        # the averager's process writes a download into the very tensors the node holds: they must be in shared
        # memory when it forks (keep_state_shared), and stay the same tensors (checked at each download)
        flat_metadata, tensors = self._state_tensors()
        if self.reuse_tensors and not self.offload_optimizer and all(t.is_shared() for t in tensors):
            self._stream = (Layout.of(flat_metadata, tensors), tensors)
        return super().run_in_background(*args, **kwargs)

    def load_state_from_peers(self, timeout: Optional[float] = None, **kwargs):
        """hivemind's download of the state of the peer of highest priority that serves one, each tensor written
        into the node's as soon as it has arrived and passed its checks (node.swarm.download): no whole second
        state is held. Sets `torn` when a download failed after it wrote some of them; a whole download clears it.
        The node shares no state while its tensors are written, nor after a download that left them torn.

        hivemind's own (the whole state received first) where the averager's process cannot write the node's
        tensors: not in shared memory when it started, or other tensors since."""
        if self._stream is None:
            return super().load_state_from_peers(timeout=timeout, **kwargs)
        layout, tensors = self._stream
        _, now = self._state_tensors()
        if len(now) != len(tensors) or any(a is not b for a, b in zip(now, tensors)):
            logger.warning("The optimizer's state tensors are no longer those the averager's process writes; "
                           "downloading the whole state first")
            return super().load_state_from_peers(timeout=timeout, **kwargs)
        sharing, self.allow_state_sharing = self.allow_state_sharing, False  # written one by one from now on
        with self.lock_averaged_tensors:
            self._downloading = True
        # a low-comm outer optimizer counts this as a write of its state (ServedState never hands it out meanwhile)
        try:
            with getattr(self.optimizer, "writing", contextlib.nullcontext)():
                outcome, loaded = self._await_download(timeout), False
                with torch.no_grad(), self.lock_averaged_tensors:
                    if outcome.metadata is not None:
                        try:  # the values are in place; the peer's scalars (hyperparameters, AdamW's step) go too
                            main = sum(len(group["params"]) for group in self.optimizer.param_groups)
                            load_optimizer_state(self.optimizer, outcome.metadata["optimizer_metadata"],
                                                 tensors[main + len(self.extra_tensors):])
                            loaded = True
                        except Exception as e:
                            logger.warning(f"Could not load the downloaded optimizer state: {e!r}")
                    self.torn = outcome.torn or (outcome.metadata is not None and not loaded) or \
                        (self.torn and not loaded)
        finally:
            with self.lock_averaged_tensors:
                self._downloading = False
        if loaded:
            self.local_epoch = outcome.metadata["epoch"]
            self._update_scheduler()
        if not self.torn:
            self.allow_state_sharing = sharing

    def _await_download(self, timeout: Optional[float]) -> Downloaded:
        future = MPFuture()
        self._outer_pipe.send(("_stream_state_from_peers", [],
                               dict(future=future, timeout=timeout, min_epoch=self.local_epoch)))
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            if not future.cancel():  # it ended just now
                return future.result()
            with self.lock_averaged_tensors:  # a write under way ends; after the cancel, none begins
                pass
            logger.warning(f"The download did not end within {timeout}s; abandoned")
            return Downloaded(None, torn=True)  # it may have written some

    async def _stream_state_from_peers(self, future: MPFuture, timeout: Optional[float], min_epoch: int):
        """In the averager's process: hivemind's _load_state_from_peers (the peers that declared their state, highest
        priority first, until one sends a whole state), each tensor written into the node's as it arrives."""
        if timeout is not None:  # as hivemind's: the bound on each chunk
            timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        layout, tensors = self._stream
        loop, torn = asyncio.get_running_loop(), False

        def write_now(index: int, tensor: torch.Tensor) -> None:
            with self.lock_averaged_tensors:
                if future.done():
                    raise Abandoned("the node stopped waiting for the download")
                with torch.no_grad():
                    tensors[index].copy_(tensor)

        async def write(index: int, tensor: torch.Tensor) -> None:
            await loop.run_in_executor(None, write_now, index, tensor)

        try:
            for peer in await self._state_peers():
                if future.done():
                    return
                started, received = time.monotonic(), Received()
                logger.info(f"Downloading the state from peer {peer} into this node's tensors")
                try:
                    stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                    metadata = await receive_into(stream, layout, self.serializer.loads, min_epoch, write, received,
                                                  timeout)
                except Exception as e:
                    torn = torn or received.written > 0
                    how = logger.info if isinstance(e, BadState) and received.written == 0 else logger.warning
                    how(f"The download from {peer} failed after {received.written} of {len(tensors)} tensors: "
                        f"{e!r}")
                    continue
                logger.info(f"Downloaded the state from {peer} in {time.monotonic() - started:.1f}s")
                future.set_result(Downloaded(metadata, torn=False))
                return
        except Exception as e:
            logger.exception(f"Downloading the state failed: {e!r}")
        finally:
            if not future.done():
                future.set_result(Downloaded(None, torn))
            memory.trim()  # the received chunks' pages, kept by glibc once free (as a donor's, rpc_download_state)

    async def _state_peers(self) -> list:
        """The peers that declared they share their state, highest priority first (ties at random), as hivemind's
        _load_state_from_peers asks them."""
        found = await self.dht.get(f"{self._matchmaking.group_key_manager.prefix}.all_averagers", latest=True,
                                   return_future=True)
        declared = found.value if found is not None and isinstance(found.value, dict) else {}
        priority = {PeerID(peer): (float(info.value), random.random()) for peer, info in declared.items()
                    if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))}
        return sorted((p for p in priority if p != self.peer_id), key=priority.get, reverse=True)

    async def rpc_download_state(self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's (in the averager's process), with the memory of each tensor copied for this download handed
        back as soon as it is serialized: the copy of the state (3P per-step, 2P low-comm) shrinks as the stream
        goes, while the joiner's tensors fill, and none of it outlives the stream, however long hivemind's host
        thread keeps its reference (until the next request). `get_current_state` hands out copies only; a tensor
        that is one of the node's own (the same memory) is never released."""
        if not self.allow_state_sharing:
            return  # the peer asks the next one
        metadata, tensors, infos = await self._get_current_state_from_host_process()
        own = {t.untyped_storage().data_ptr() for t in self._stream[1]} if self._stream is not None else None

        def release(sent: Sequence[torch.Tensor]) -> None:
            if own is not None:
                memory.release([t for t in sent if t.untyped_storage().data_ptr() not in own])

        if infos is None:
            infos = [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(tensors)]
        if len(tensors) != len(infos):
            raise ValueError(f"{len(tensors)} tensors, {len(infos)} compression infos")
        try:
            for tensor, info in zip(tensors, infos):
                serialized = self.state_compression.compress(tensor, info, allow_inplace=False)
                release([tensor])  # the serialized bytes are a copy of their own
                for part in split_for_streaming(serialized):
                    await self._pace.spend(part.ByteSize())  # --serve-state-mbit: room for the donor's own traffic
                    if metadata is not None:  # with the first part only
                        yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
                        metadata = None
                    else:
                        yield averaging_pb2.DownloadData(tensor_part=part)
        finally:  # a stream cut short: what it did not send goes too
            release(tensors)
            del tensors
            # the stream's parts (under glibc's mmap threshold, from this process's heap) are free now, but glibc
            # keeps such pages (as the receiving side's: 0.4 GiB of GPT-2 medium's state, _stream_state_from_peers)
            memory.trim()

    def step(self, *args, averaging_round: bool = False, averaging_control=None, increment_epoch: bool = False,
             averaging_opts: Optional[dict] = None, **kwargs):
        """hivemind's, and once it returns, no all-reduce of this round writes the training tensors any more.

        hivemind waits for a state round only until its timeout; the round may then still find its group and
        average in place while the node reads and writes the parameters. A round not begun is cancelled, and one
        that is running holds lock_averaged_tensors until it is done, so taking that lock waits for it. A round
        hivemind would begin inside its step is begun here, as it would (gathering the epoch after the step), so
        that it can be cancelled."""
        if averaging_round and averaging_control is None:
            averaging_control = self.schedule_step(gather=self.local_epoch + int(increment_epoch),
                                                   **(averaging_opts or {}))
        output = super().step(*args, averaging_round=averaging_round, averaging_control=averaging_control,
                              increment_epoch=increment_epoch, averaging_opts=averaging_opts, **kwargs)
        if averaging_round and averaging_control is not None and not averaging_control.done():
            averaging_control.cancel()
        if averaging_round:
            with self.lock_averaged_tensors:
                pass
        return output

    def get_current_state(self):
        """hivemind's, with every tensor copied now. hivemind hands the downloading peer's stream views of the live
        parameters and optimizer state and serializes each when the stream reaches it; over a home uplink that is
        tens of seconds later, after the node's next updates: a torn state (parameters of one moment, momentum of
        another) that no digest check of the parameters can catch, and a joiner that never catches up. The copies
        are made under lock_averaged_tensors, which an all-reduce writing the same tensors holds.

        Low-comm (`served` set): the parameters are those of the served snapshot, so a node hands out the swarm's
        state of its epoch during its inner updates too (before, it shared nothing then, and a node that missed a
        round found no peer to download from until the next round). The outer optimizer's state goes with them
        when it is still the one of that epoch; while an outer step or a load writes it, the request waits
        (SERVED_WAIT_S) for the snapshot that follows, else fails and the peer asks another."""
        if self.served is None:
            metadata, tensors, infos = super().get_current_state()
            with self.lock_averaged_tensors:
                if self._downloading or self.torn:  # a request that came before sharing was turned off
                    raise StateNotServed("this node's tensors are being written by a download, or hold part of one")
                tensors = [t.clone() for t in tensors]
            return metadata, tensors, infos
        outer, deadline = self.optimizer, time.monotonic() + SERVED_WAIT_S
        while True:
            served, version = self.served, outer.version
            metadata, tensors, infos = super().get_current_state()
            n = len(served.params)
            with self.lock_averaged_tensors:
                rest = [t.clone() for t in tensors[n:]]
            if version % 2 == 0 and outer.version == version == served.version and metadata["epoch"] == served.epoch:
                params = [torch.tensor(a).view_as(t) for a, t in zip(served.params, tensors[:n])]
                return metadata, params + rest, infos
            if time.monotonic() >= deadline:
                raise StateNotServed(f"no settled state of one epoch within {SERVED_WAIT_S:g}s (epoch "
                                     f"{metadata['epoch']}, served {served.epoch})")
            time.sleep(0.05)
