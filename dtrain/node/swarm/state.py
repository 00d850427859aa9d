"""The swarm's state as a node holds and hands it out: the training tensors kept in shared memory where hivemind's
processes use them in place (`keep_state_shared`), and the state averager that averages them and answers a joiner's
download with one moment's state (`SwarmStateAverager`; in low-comm mode the served epoch's, `ServedState`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from hivemind.optim.state_averager import TrainingStateAverager

from dtrain.node import memory
from dtrain.node.swarm.deadlines import Retimable
from dtrain.node.swarm.keygate import KeyGatedServicer


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
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.device.type == "cpu" and not value.is_shared():
                    value.share_memory_()

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


class SwarmStateAverager(Retimable, KeyGatedServicer, TrainingStateAverager):
    """hivemind's state averager (parameter and state averaging, state downloads) whose RPCs, in a closed swarm,
    answer only peers that prove the key (node.swarm.keygate), and whose downloads are one moment's state."""

    def __init__(self, *args, **kwargs):
        # the parameters and optimizer state are the averaged tensors themselves (they are in shared memory already,
        # node.swarm.state.keep_state_shared): no second copy of them (up to 3P). An all-reduce then writes the
        # training tensors: it holds lock_averaged_tensors while it does, and `step` waits for it to let go
        self.served: Optional[ServedState] = None
        super().__init__(*args, reuse_tensors=True, **kwargs)

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
