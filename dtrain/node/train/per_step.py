"""The training loop in per-step mode (`--sync per-step`): every update of the swarm averages the gradient, then the
parameters and Adam moments (hivemind.Optimizer around the node's AdamW), and every update is a served step.

One iteration: the hand-overs the pool has ready go into the pending gradient (alone, each one is an update: the
spec's single server), then one batch of the node's own data, then the catch-up a node behind the swarm needs, then
one hivemind Optimizer.step, which reports the samples and runs the update once the swarm gathered enough. Training
thread only.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from hivemind.utils.logging import get_logger

from dtrain.node.snapshot import Snapshot
from dtrain.node.train.robust import all_finite, optimizer_state_tensors

if TYPE_CHECKING:  # the node core the loop runs on (node.train.trainer); it imports no loop's module at run time
    from dtrain.node.train.trainer import TrainingNode

logger = get_logger(__name__)


class PerStepLoop:
    def __init__(self, node: "TrainingNode"):
        self.node = node

    def iteration(self) -> bool:
        """Returns whether there was work (else the training thread waits for a hand-over, briefly)."""
        node, worked = self.node, False
        while (hand_over := node.pool.take()) is not None:
            node.intake.add(hand_over.contributions)
            del hand_over  # its packets' widened arrays (about 4x a Mode 2 packet) go before the update, not after
            worked = True
            if node.alone():
                self.step()
        if node.dataset is not None and node.wants_local_batch():
            node.local_batch()
            worked = True
        # a peer behind the swarm takes its state first, so that its gradient joins the swarm's next round
        node.follower.catch_up()
        if node.gradient.samples > 0 or self._round_for_clients():
            self.step()  # lets hivemind schedule and run the update the swarm is gathering samples for
        node.housekeeping()
        return worked

    def step(self) -> None:
        """One hivemind Optimizer.step reporting the samples gathered since the last call."""
        node = self.node
        opt = node.swarm.optimizer
        # a peer that served this epoch's bytes after we compared; always right before an update
        node.follower.recheck(force=opt.tracker.ready_to_update_epoch)
        if node.unverified:
            return  # no update on bytes the swarm disagrees with: catch up first
        counted = opt.grad_averager  # hivemind's own counters: a download resets them without a new epoch
        new_samples = max(node.gradient.samples - counted.local_samples_accumulated, 0)
        node.gradient.write_grads(list(node.model.parameters()), counted.local_times_accumulated + 1)
        epoch_before, round_before = opt.local_epoch, opt.last_round
        before = node.publisher.snapshot
        if new_samples:
            node.presence.reported_samples()
        started = time.monotonic()
        opt.step(batch_size=new_samples)
        if opt.state_averager.torn:  # hivemind's download inside step() failed part-way: loaded again
            node.unverified = True
        if opt.local_epoch == epoch_before:
            return
        outcome = opt.last_round
        if outcome is not round_before and outcome.epoch == opt.local_epoch:
            self._refuse_non_finite(before)
            del before  # the served snapshot until the next one is published: then its bytes can go
            publisher = node.publisher
            verdict = publisher.agree(outcome)
            snap = publisher.snapshot_of(verdict)
            if not publisher.served(verdict, snap, outcome, started):
                node.unverified = True  # keep serving the last step; catch_up downloads again
        else:  # hivemind downloaded the swarm's state inside step() ("Peer is out of sync")
            node.follower.after_catch_up(node.agreement.check_download())

    def _refuse_non_finite(self, before: Optional[Snapshot]) -> None:
        """Never a non-finite model: an update that left a parameter or Adam moment non-finite (a peer's average,
        since this node's own gradient was checked) is undone to the parameters served before it."""
        node = self.node
        opt = node.swarm.optimizer.state_averager.optimizer
        if before is None or all_finite(list(node.model.parameters()) + optimizer_state_tensors(opt)):
            return
        logger.error(f"Update {node.swarm.epoch} left non-finite parameters or moments: keeping step {before.step}'s "
                     f"parameters and zeroing the non-finite moments")
        with torch.no_grad():
            for p, saved in zip(node.model.parameters(), before.f32):
                p.copy_(torch.from_numpy(np.array(saved)).view_as(p))
            for t in optimizer_state_tensors(opt):
                torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)

    def _round_for_clients(self) -> bool:
        """A full peer with nothing of its own joins (with weight 0) an update the swarm gathered samples for while
        a client-mode peer is in it: client-mode peers cannot lead an averaging group, so without a full peer in the
        round their gradients would never be averaged (docs/home-nodes.md)."""
        node = self.node
        if node.swarm.client_mode or node.unverified:
            return False
        tracker = node.swarm.optimizer.tracker
        progress = tracker.global_progress
        return progress.num_clients > 0 and progress.samples_accumulated > 0 and tracker.ready_to_update_epoch
