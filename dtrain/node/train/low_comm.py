"""The training loop in low-communication mode (`--sync low-comm`, the default; docs/low-communication.md).

    inner loop:  hand-overs and batches of the node's own data -> pending gradient -> one inner AdamW update
    outer round: once the round is due (--inner-steps inner updates and --min-round-seconds): one hivemind
                 Optimizer.step that averages the pseudo-gradients (anchor - parameters) and applies the outer
                 Nesterov step; its result is the next served step (node.train.publication). With peers, the
                 next local batches train meanwhile (node.train.ahead): the next round's first inner update, or
                 where the inner loop trains a copy of its own (a GPU, --inner-copy) inner updates of the copy

node.lowcomm.rounds.InnerRounds keeps the anchor, the pseudo-gradient set aside and the error feedback. A served
step is an outer round, for a node alone too: its inner updates are its own, not published, hashed or recorded.
The one exception is the spec's single server: a node alone that nothing but contributors' packets trains makes one
update per hand-over. Training thread only.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from hivemind.utils.logging import get_logger

from dtrain.node.checkpoint import Checkpoint, RoundState
from dtrain.node.train.adamw import regroup_state_dict

if TYPE_CHECKING:  # the node core the loop runs on (node.train.trainer); it imports no loop's module at run time
    from dtrain.node.train.trainer import TrainingNode

logger = get_logger(__name__)


class LowCommLoop:
    def __init__(self, node: "TrainingNode"):
        self.node = node
        self.round_due = False  # what the tracker asks (node.swarm.tracker.PacedTracker.round_due)

    def iteration(self) -> bool:
        """Inner updates until the round is due, then the outer round; returns whether there was work. Once the
        round is due a node takes no hand-over and trains on no local batch until the round: its packets wait in
        the pool, and the swarm's samples stop growing when every node is done, which begins the round."""
        node, rounds, worked = self.node, self.node.rounds, False
        while not rounds.due and (hand_over := node.pool.take()) is not None:
            node.intake.add(hand_over.contributions)
            del hand_over
            worked = True
            self._inner_update()
            if self._single_server():
                self._outer_round()
        if node.dataset is not None and not rounds.due and node.wants_local_batch():
            node.local_batch()
            self._inner_update()
            worked = True
        node.follower.catch_up()
        # a copy's updates made while the last round ran count before the next round begins, whichever call ended
        # it (a catch-up may have, just now): they are in the parameters that round offers
        worked |= self._credit_trained()
        if node.gradient.samples > 0:
            self._outer_round()
        worked |= self._train_ahead()
        node.housekeeping()
        return worked

    def _single_server(self) -> bool:
        """The spec's single server: alone, and trained by contributors' packets only, every hand-over is one
        served update. A node that trains on its own data serves a step per outer round, alone or not."""
        return not self.node.trains_on_own_data() and self.node.alone()

    def _inner_update(self) -> None:
        node = self.node
        if node.gradient.undrained_samples:
            # a peer's download gets the served snapshot, never these parameters (node.swarm.state.ServedState)
            node.rounds.inner_step(node.gradient.drain())

    def _outer_round(self) -> None:
        """One hivemind Optimizer.step, once the round is due (or for the single server): reports the samples of the
        inner updates and runs the round. The parameters stay where the inner updates left them inside it (the outer
        step goes from the anchor, a download sets them aside first: node.lowcomm.rounds): whatever replaces them
        there (an outer update, a download) is followed by settle or carry."""
        node = self.node
        opt, rounds = node.swarm.optimizer, node.rounds
        alone = node.alone()
        self.round_due = rounds.due or (alone and not node.trains_on_own_data())
        if self.round_due:  # its record says so, and it reads the swarm's progress at once (slower between rounds)
            opt.tracker.round_is_due()
        if not self.round_due:
            self._report()
            return
        started = time.monotonic()
        inner_updates = rounds.steps
        outer = opt.state_averager.optimizer
        outer.passthrough, outer.source = alone, rounds.begin()
        node.follower.recheck(force=opt.tracker.ready_to_update_epoch)  # may download the swarm's bytes of the last step
        if node.unverified:
            rounds.carry()
            return
        counted = opt.grad_averager
        new_samples = max(node.gradient.samples - counted.local_samples_accumulated, 0)
        calls = counted.local_times_accumulated + 1  # hivemind divides .grad by the step() calls of the epoch
        # alone, the whole pseudo-gradient; with peers, what the codec sends of it
        rounds.write_offer([p.grad for p in node.model.parameters()], calls, compress=not alone)
        if node.catchup is not None:  # the sparse codec: its averager sends these bytes, and the record holds them
            counted.round_files.hand_offer(opt.local_epoch, rounds.payload())
        epoch_before, round_before = opt.local_epoch, opt.last_round
        if new_samples:
            node.presence.reported_samples()
        if node.ahead is not None and not alone and node.trains_on_own_data():
            # the next batches while the round waits (stopped before it writes what they read); a resident loop's
            # inner updates, as many as this round made between rounds (a round late, never more)
            node.ahead.start(max_steps=max(rounds.inner_steps, rounds.between_rounds))
        try:
            opt.step(batch_size=new_samples)
        finally:
            if node.ahead is not None:
                node.ahead.stop()
        if opt.state_averager.torn:  # hivemind's download inside step() failed part-way: loaded again
            node.unverified = True
        if opt.local_epoch == epoch_before:
            if rounds.due and rounds.holds_inner():
                # waiting for the round: in it, its offer made once; a joiner downloads the served snapshot
                node.publisher.share_state()
                return
            rounds.carry()  # back to the inner updates' parameters (on the swarm's bytes, if a download came)
            node.publisher.share_state()
            return
        outcome = opt.last_round
        if outcome is not round_before and outcome.epoch == opt.local_epoch:
            if alone:
                rounds.landed()  # .grad (and parameters set aside, if any) go before the update's snapshot is made
            if node.catchup is not None:
                node.catchup.record(outcome)
            self._publish(outcome, started, inner_updates)
        else:  # hivemind downloaded the swarm's state inside step()
            node.follower.after_catch_up(node.agreement.check_download())

    def _train_ahead(self) -> bool:
        """Once the round is over, what was trained while it ran (node.train.ahead) is the next round's: the inner
        updates a resident loop made (their samples and loss; the round's end put them on the new parameters), and
        batches no update applied yet, which make the next inner update. Returns whether there was any."""
        node = self.node
        if node.ahead is None or node.rounds.in_outer:
            return False
        if node.ahead.error is not None:
            error, node.ahead.error = node.ahead.error, None
            raise error
        credited = self._credit_trained()
        batch = node.ahead.take()
        if batch is None:
            return credited
        node.add_local(batch)
        del batch
        self._inner_update()
        return True

    def _credit_trained(self) -> bool:
        """A resident loop's inner updates made while the last round ran: their samples and loss join the pending
        gradient, once the round is over. Returns whether there were any."""
        node = self.node
        if node.ahead is None or node.rounds.in_outer:
            return False
        samples, loss = node.ahead.take_trained()
        if samples:
            node.gradient.add_trained(samples, loss)
        return samples > 0

    def _publish(self, outcome, started: float, inner_updates: int) -> None:
        """The outer update's step served: the peers agree on its digest, the round's buffers go, its snapshot
        becomes the next anchor (or, without this node's pseudo-gradient in it, the pseudo-gradient is carried)."""
        node, rounds, publisher = self.node, self.node.rounds, self.node.publisher
        verdict = publisher.agree(outcome)
        if verdict.included:
            rounds.applied()  # .grad and the offer go before the snapshot (P) is made
        snap = publisher.snapshot_of(verdict)
        if verdict.included:  # the anchor: the snapshot's bytes, which the node publishes below
            rounds.settle(snap.f32 if snap is not None else None)
        else:
            rounds.carry()
        publisher.share_state()
        if not publisher.served(verdict, snap, outcome, started, inner_updates):
            node.unverified = True  # keep serving the last step; catch_up downloads again

    def _report(self) -> None:
        """With peers, before this node's inner updates are done: its new samples go to the swarm's progress, and
        nothing else. No round can begin (the tracker waits for this node's), so the parameters stay where the inner
        updates left them: no set-aside copy and no offer until the round is due. A download the swarm's progress
        calls for comes from `catch_up`, which sets the pseudo-gradient aside itself."""
        node = self.node
        node.follower.recheck(force=False)  # a download (following another peer's bytes) sets them aside first
        if node.rounds.in_outer:
            node.rounds.carry()  # onto the bytes it downloaded
            node.publisher.share_state()
        opt = node.swarm.optimizer
        new_samples = max(node.gradient.samples - opt.grad_averager.local_samples_accumulated, 0)
        if new_samples and not node.unverified:
            node.presence.reported_samples()
            opt.report_samples(new_samples)

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def round_state(self) -> RoundState:
        """The round in progress, for a checkpoint (node.checkpoint): what a restarted node needs to go on with it."""
        rounds = self.node.rounds
        return RoundState(inner_params=rounds.inner_parameters(), feedback=rounds.feedback, steps=rounds.steps,
                          inner_optimizer_state=_on_cpu(rounds.inner.state_dict()))

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


def _on_cpu(state: dict) -> dict:
    """An optimizer's state_dict with its tensors on the CPU (a resident inner AdamW's are on the device); loading it
    puts them back where the parameters are."""
    return {"state": {i: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in per.items()}
                      for i, per in state["state"].items()},
            "param_groups": state["param_groups"]}
