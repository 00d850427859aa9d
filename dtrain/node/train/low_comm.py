"""The training thread's iteration in low-communication mode (`--sync low-comm`, docs/low-communication.md).

`TrainingNode` owns the model, the swarm and the catch-up; in low-comm mode each of its iterations is this loop's:
inner AdamW updates on hand-overs and local batches until --inner-steps are done, then one hivemind
Optimizer.step that runs the outer round (node.lowcomm.rounds.InnerRounds keeps the anchor, the pseudo-gradient set
aside and the error feedback). Training thread only.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from hivemind.utils.logging import get_logger

from dtrain.node.checkpoint import Checkpoint, RoundState
from dtrain.node.swarm.optimizer import regroup_state_dict

if TYPE_CHECKING:
    from dtrain.node.train.trainer import TrainingNode

logger = get_logger(__name__)


class OuterRoundLoop:
    """One low-comm node's iterations. It works on its node's parts (pool, pending gradient, rounds, swarm) and
    hands updates and downloads back to the node, which serves them."""

    def __init__(self, node: TrainingNode):
        self.node = node
        self.round_due = False  # what the tracker asks (node.swarm.optimizer.PacedTracker.round_due)

    def iteration(self) -> bool:
        """Inner updates until --inner-steps are done, then the outer round. Once done, a node takes no hand-over
        and trains on no local batch until the round: its packets wait in the pool, and the swarm's samples stop
        growing when every node is done, which begins the round."""
        node = self.node
        worked, rounds = False, node.rounds
        while not rounds.due and (hand_over := node.pool.take()) is not None:
            node._add(hand_over.contributions)
            del hand_over
            worked = True
            self._inner_step()
            if node._alone():
                self._step()  # alone, every hand-over is one update (the spec's single server)
        if node.dataset is not None and not rounds.due and node._wants_local_batch():
            node._local_batch()
            self._inner_step()
            worked = True
        node._catch_up()
        if node.gradient.samples > 0:
            self._step()
        node._housekeeping()
        return worked

    def _inner_step(self) -> None:
        node = self.node
        if node.gradient.undrained_samples:
            # a peer's download gets the served snapshot, never these parameters (node.swarm.state.ServedState)
            node.rounds.inner_step(node.gradient.drain())

    def _step(self) -> None:
        """One hivemind Optimizer.step, once the round is due (or the node is alone): reports the samples of the
        inner updates and runs the round. The parameters stay where the inner updates left them inside it (the outer
        step goes from the anchor, a download sets them aside first: node.lowcomm.rounds): whatever replaces them
        there (an outer update, a download) is followed by settle or carry."""
        node = self.node
        opt, rounds = node.swarm.optimizer, node.rounds
        alone = node._alone()
        self.round_due = alone or rounds.due
        if not self.round_due:
            self._report()
            return
        outer = opt.state_averager.optimizer
        outer.passthrough, outer.source = alone, rounds.begin()
        node._recheck(force=opt.tracker.ready_to_update_epoch)  # may download the swarm's bytes of the last step
        if node._unverified:
            rounds.carry()
            return
        counted = opt.grad_averager
        new_samples = max(node.gradient.samples - counted.local_samples_accumulated, 0)
        calls = counted.local_times_accumulated + 1  # hivemind divides .grad by the step() calls of the epoch
        with torch.no_grad():  # alone, the whole pseudo-gradient; with peers, what the codec sends of it
            for p, d in zip(node.model.parameters(), rounds.offer(compress=not alone)):
                p.grad.copy_(d).mul_(calls)
        epoch_before, round_before = opt.local_epoch, opt.last_round
        if new_samples:
            node.presence.reported_samples()
        started = time.monotonic()
        opt.step(batch_size=new_samples)
        if opt.state_averager.torn:  # hivemind's download inside step() failed part-way: loaded again
            node._unverified = True
        if opt.local_epoch == epoch_before:
            if rounds.due and rounds.holds_inner():
                # waiting for the round: in it, its offer made once; a joiner downloads the served snapshot
                node._share_state()
                return
            rounds.carry()  # back to the inner updates' parameters (on the swarm's bytes, if a download came)
            node._sync_sharing()
            return
        outcome = opt.last_round
        if outcome is not round_before and outcome.epoch == opt.local_epoch:
            if alone:
                rounds.landed()  # .grad (and parameters set aside, if any) go before the update's snapshot is made
            if node.catchup is not None:
                node.catchup.record(outcome)
            node._after_update(outcome, time.monotonic() - started)
            node._updated(time.monotonic() - started)
        else:  # hivemind downloaded the swarm's state inside step()
            node._after_catch_up(node.agreement.check_download())

    def _report(self) -> None:
        """With peers, before this node's inner updates are done: its new samples go to the swarm's progress, and
        nothing else. No round can begin (the tracker waits for this node's), so the parameters stay where the inner
        updates left them: no set-aside copy and no offer until the round is due. A download the swarm's progress
        calls for comes from `_catch_up`, which sets the pseudo-gradient aside itself."""
        node = self.node
        node._recheck(force=False)  # a download (following another peer's bytes) sets them aside first
        if node.rounds.in_outer:
            node.rounds.carry()  # onto the bytes it downloaded
            node._sync_sharing()
        opt = node.swarm.optimizer
        new_samples = max(node.gradient.samples - opt.grad_averager.local_samples_accumulated, 0)
        if new_samples and not node._unverified:
            node.presence.reported_samples()
            opt.report_samples(new_samples)

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def round_state(self) -> RoundState:
        """The round in progress, for a checkpoint (node.checkpoint): what a restarted node needs to go on with it."""
        rounds = self.node.rounds
        return RoundState(inner_params=rounds.inner_parameters(), feedback=rounds.feedback, steps=rounds.steps,
                          inner_optimizer_state=rounds.inner.state_dict())

    def resume(self, restored: Checkpoint) -> None:
        """A restarted node's round from its checkpoint (checked against the model by checkpoint.check_fits):
        the inner AdamW's state, the error feedback and the pseudo-gradient, on the anchor the node starts from."""
        rounds, saved = self.node.rounds, restored.round
        state = saved.inner_optimizer_state
        if len(state["param_groups"]) != len(rounds.inner.param_groups):
            state = regroup_state_dict(state, rounds.inner)
        rounds.inner.load_state_dict(state)
        saved_anchor = [restored.params[name] for name, _ in self.node.model.named_parameters()]
        rounds.resume(saved_anchor, saved.inner_params, saved.feedback, saved.steps)
        logger.info(f"Resumed the round in progress: {saved.steps} inner updates"
                    + (", with error feedback" if saved.feedback is not None else ""))
