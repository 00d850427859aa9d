"""hivemind.Optimizer as the node needs it (`SwarmOptimizer`).

Six changes to hivemind's: a gradient round is applied whole or not at all (node.swarm.commit), it applies the
node's exact gradient whenever the swarm's average is unavailable, a client-mode peer never updates without the
swarm's average (nor, for two failed rounds in a row, does a low-comm peer while others train), it reports each
update's outcome (which peers' gradients went into it), an update also begins when the swarm's pending samples
stop growing (node.swarm.tracker), so a swarm keeps its pace when a peer leaves whatever target it was started
with, and a low-comm round's group closes once the peers at the swarm's epoch are in it (node.swarm.groupsize), not
when matchmaking's time is up.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Sequence

import hivemind
import torch
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

from dtrain.node.swarm.commit import AbortedRound, chunk_timeout
from dtrain.node.swarm.deadlines import Deadline, Retimable, RoundClock
from dtrain.node.swarm.groupsize import BehindTheSwarm, ExpectedGroup, SameEpochGroup
from dtrain.node.swarm.others import Others
from dtrain.node.swarm.state import SwarmStateAverager
from dtrain.node.swarm.tracker import PacedTracker

logger = get_logger(__name__)

SKIP_LOG_EVERY_S = 10.0  # at most one log line this often for rounds that made no update
SWARM_EPOCH_EVERY_S = 1.0  # how often the swarm's epoch is read while this peer waits for its round


@dataclass(frozen=True)
class RoundOutcome:
    """Whose gradients one update of this peer applied."""

    epoch: int  # the epoch the update made
    group: tuple[str, ...]  # peer ids whose gradients were averaged (this peer alone when it used its own)
    clean: bool  # the gradient round completed on this peer (or it was alone): its gradient is in the average


class NoSwarmRound(Exception):
    """This peer makes no update in this round (SwarmOptimizer): its round did not complete and it may not update
    alone, or the others committed it without this peer. The message is the log line."""


class SwarmOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that applies this peer's exact gradient whenever the swarm's average is unavailable and
    reports the outcome of every update (`last_round`).

    hivemind 1.1.12 resets its gradient accumulators when a gradient all-reduce begins. When that round then
    fails (a peer times out), its fallback "proceeding with local gradients" reloads the zeroed accumulators, so
    the update is weight decay alone and the samples are lost. With no other peer it applies the accumulators
    without dividing them by the number of step() calls. The node keeps its own exact gradient and hands it in
    through `local_gradients`.

    A client-mode peer (behind NAT) never updates on its own gradient. Its state can be downloaded by no one, so an
    update alone would make bytes for the next epoch that no other peer has: its packets applied on itself only,
    and its epoch split from the swarm's. When its round fails (no public peer led a group it could join, or the
    all-reduce broke) it makes no update at all (`skipped_rounds`): its gradient stays pending, the swarm's next
    update is downloaded when the swarm moves on, and the gradient joins the round after, with the swarm.
    """

    def __init__(self, *, local_gradients: Callable[[], Sequence[torch.Tensor]], update_bonus: float,
                 settle_s: float, swarm_key: Optional[bytes] = None, failed_rounds_carried: int = 0,
                 others: Optional[Others] = None, round_due: Optional[Callable[[], bool]] = None,
                 before_state_load: Optional[Callable[[], None]] = None, **kwargs):
        """`local_gradients`: this peer's exact gradient, applied when the swarm's average is unavailable;
        `others`: what the node knows of the other peers (node.swarm.others; None: no one), read by the tracker
        (node.swarm.tracker.PacedTracker, with `round_due`) and here: a peer `isolated` from the peers it trained
        with makes no update alone, and after a round that gave no update, before the swarm's progress is read
        again, the node pings its peers (`reach_now`). `before_state_load`: called before every download of the
        state, which replaces the parameters (low-comm: the node sets the inner updates' parameters aside,
        node.lowcomm.rounds.InnerRounds.enter_outer).
        `failed_rounds_carried`: how many failed rounds in a row at one epoch make no update while other peers train
        (`_no_round_alone`); 0: every failed round is an update on this peer's own gradient."""
        self._local_gradients = local_gradients
        self._others = others if others is not None else Others()
        self._round_due = round_due
        self._swarm_key = swarm_key  # a closed swarm: the state averager's RPCs answer only holders of the key
        self._update_bonus = update_bonus  # added to the epoch as this peer's state-sharing priority after an update
        self._settle_s = settle_s
        self.last_round: Optional[RoundOutcome] = None
        self._round_group: tuple[str, ...] = ()
        self._round_clean = False
        self.skipped_rounds = 0  # rounds that failed with no gradient this peer could apply alone: no update
        self._failed_rounds_carried = failed_rounds_carried
        self._failed_in_a_row = (-1, 0)  # (epoch, rounds of that epoch that failed so far)
        self.arrived_in: Optional[int] = None  # the epoch this peer arrived in late (node.train.follow.arrive_late)
        self._round_samples = 0  # samples this peer brought to the round being run
        self._next_skip_log = 0.0
        # called with .grad holding what an update is about to apply (averaged, or this peer's own)
        self.before_update: Optional[Callable[[], None]] = None
        self.on_state_loaded: Optional[Callable[[], None]] = None  # called after every download of the state
        self.before_state_load = before_state_load
        self.node_catches_up = False  # the node brings a peer behind the swarm up to date itself (never step())
        # each gradient round's measured exchange (or its running out of time) sets the next one's deadline
        self.round_clock: Optional[RoundClock] = None
        self._exchanges_seen = 0
        if kwargs.get("grad_averager_factory") is not None:  # its groups hold peers at this peer's epoch
            kwargs["grad_averager_factory"] = partial(kwargs["grad_averager_factory"],
                                                      round_epoch=lambda: self.local_epoch)
        super().__init__(**kwargs)

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        # hivemind's own, with the state averager's class gated by the swarm key
        return SwarmStateAverager(
            swarm_key=self._swarm_key, dht=self.dht, prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time, allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout, offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer, status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout, client_mode=self.client_mode, auxiliary=self.auxiliary,
            start=True, **kwargs)

    def _no_round_alone(self, reason: str, others: bool = True, behind: bool = False, carry: bool = True) -> None:
        # A client-mode peer never updates alone (see the class docstring); nor does a full peer that only joined
        # the round for client-mode peers' sake (no samples of its own): alone, its update would be Adam's
        # momentum and weight decay, asked for by no one. Nor, while `others` train, does a peer in the epoch it
        # arrived in late (`arrived_in`): they began the epoch before it, and when its first round misses theirs
        # their update is the swarm's; its own would be bytes they do not have, which it would then download whole.
        # Nor, with `failed_rounds_carried`, does a peer whose round failed while others train (`carry`: the swarm's
        # progress shows other peers). They failed the same round (node.swarm.commit: nobody applies a round that is
        # incomplete anywhere), so if each updated alone, every peer would hold bytes of its own, and all but one
        # would then download the state of the one the agreement serves (41 s at 20 Mbit/s for the default model).
        # Making no update, they stay on one anchor and average their gradients in the next round, which a member
        # that left no longer holds up (node.lowcomm.gather). After that many failures in a row the peer updates
        # alone, so a round that keeps failing for one peer cannot stall it for ever. Nor, whatever the swarm's
        # progress shows, does a peer `isolated` from the peers it trained with (node.swarm.contact): alone, it
        # would run its epoch ahead of theirs, and when it reached them again they would take its bytes for the
        # swarm's; making none, it is behind them then, catches up and carries its gradient into their next round.
        failed = self._failed_round()
        if behind:  # its round ended in matchmaking (node.swarm.groupsize): the swarm's update is already made
            why = ": the swarm moved on; this peer catches up and its gradient waits for the swarm's next round"
        elif self.client_mode:
            why = " alone (client mode); this peer's gradient waits for the swarm's next round"
        elif self._round_samples == 0:
            why = " alone (no samples of its own)"
        elif others and self.local_epoch == self.arrived_in:
            why = " alone in the epoch it arrived in late; its gradient waits for the swarm's next round"
        elif others and carry and failed <= self._failed_rounds_carried:
            why = (f" alone while others train; its gradient waits for the swarm's next round ({failed} of at most "
                   f"{self._failed_rounds_carried} failed rounds in a row)")
        elif self._others.isolated():
            why = " alone: this peer reaches none of the peers it trained with; its gradient waits for them"
        else:
            return
        raise NoSwarmRound(f"Gradient round failed ({reason}): no update{why}")

    def _failed_round(self) -> int:
        """One more failed round at this peer's epoch: how many have failed there in a row."""
        epoch, count = self._failed_in_a_row
        self._failed_in_a_row = (self.local_epoch, count + 1 if epoch == self.local_epoch else 1)
        return self._failed_in_a_row[1]

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return PacedTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                             client_mode=self.client_mode, status_loglevel=self.status_loglevel, start=True,
                             settle_s=self._settle_s, others=self._others, round_due=self._round_due,
                             on_swarm_epoch=self._swarm_at,
                             **kwargs)

    def _swarm_at(self, epoch: int) -> None:
        """The tracker read the swarm's epoch (its fetcher's thread): a round of this peer still looking for a group
        at an older one ends (node.swarm.groupsize.BehindTheSwarm)."""
        averager = getattr(self, "grad_averager", None)  # made after the tracker
        if isinstance(averager, SameEpochGroup):
            averager.swarm_at(epoch)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @property
    def round_group(self) -> tuple[str, ...]:
        """The peers whose gradients the update being made averages (this peer alone when it uses its own)."""
        return self._round_group

    def _load_exact_local_gradients(self) -> None:
        params = [p for group in self.state_averager.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for param, grad in zip(params, self._local_gradients()):
                param.grad.copy_(grad.view_as(param))
        if getattr(self.grad_averager, "grads_averaged_in_place", False):
            # .grad holds the mean itself now, and is the round's tensors too (node.swarm.commit): when hivemind
            # still loads its accumulators into them (it does when a round could not begin), it divides by one
            self.grad_averager.local_times_accumulated = 1

    def _load_local_gradients_into_optimizer(self):
        self._load_exact_local_gradients()
        self.grad_averager.notify_used_averaged_gradients()

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        self._round_group, self._round_clean = (self.peer_id,), False
        self._round_samples = self.grad_averager.local_samples_accumulated  # the round resets it
        if self.scheduled_grads is None and self.tracker.global_progress.num_peers > 1:
            # A round that was not pre-scheduled (the first one with company) would get hivemind's default deadline,
            # none: the wait for its outcome below was then unbounded (inf, which threading refuses), this peer
            # took the round as failed and updated alone while its averager went on, found a group and averaged
            # this peer's gradient into the others' update, which the peer, having lost the agreement, then carried
            # into a later one too. With the swarm's deadline the round is decided within the wait.
            self._expect_group()
            self.scheduled_grads = self.grad_averager.schedule_step(timeout=self.averaging_timeout)
        began = super()._begin_averaging_gradients(grad_scaler)
        if not began:  # hivemind's reasons: alone in the swarm's progress, or a pre-scheduled round already used
            self._no_round_alone("the gradient round could not begin",
                                 carry=self.tracker.global_progress.num_peers > 1)
            # hivemind goes on with whatever is in .grad (the raw accumulators): put the exact gradient there
            self._load_exact_local_gradients()
            if self.before_update is not None:  # as after a round: this update goes into the round log too
                self.before_update()
            self._round_clean = self.tracker.global_progress.num_peers <= 1  # alone: nothing to average with
        return began

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        self._load_round_gradients(maybe_step_control)
        if self.before_update is not None:
            self.before_update()

    def report_samples(self, batch_size: int) -> None:
        """What step() does with `batch_size` new samples when no update is due, and nothing else: counts them
        toward this peer's next update and reports its progress to the swarm. For a peer that knows no update of its
        can begin (low-comm: its inner updates are not done): no download, no round, and `.grad` is not read."""
        self.grad_averager.accumulate_grads_(batch_size)
        self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)

    def _should_load_state_from_peers(self) -> bool:
        # hivemind downloads the whole state inside step() when this peer is behind; a node that replays the
        # rounds it missed (node.lowcomm.roundlog) would then download what it just replayed
        return False if self.node_catches_up else super()._should_load_state_from_peers()

    def load_state_from_peers(self, **kwargs):
        if self.before_state_load is not None:
            self.before_state_load()
        super().load_state_from_peers(**kwargs)
        self.tracker.read_before_next_round()  # its last read saw the swarm from an earlier epoch
        if self.on_state_loaded is not None:
            self.on_state_loaded()

    def _load_round_gradients(self, maybe_step_control) -> None:
        """.grad for the update: the round's average, or this peer's exact gradient (or NoSwarmRound)."""
        if maybe_step_control is None:
            self._no_round_alone("no other peer in the swarm's progress", others=False)
            self._round_clean = True  # "no other peers": this peer's gradient is the whole update
            self._load_exact_local_gradients()
            self.grad_averager.notify_used_averaged_gradients()
            return
        try:
            # the averager decides within its deadline (matchmaking) plus one all-reduce with its commit step: waiting
            # longer than that, this peer never uses its own gradient while the others apply a round it committed
            bound = max(0.0, maybe_step_control.deadline - get_dht_time()) + self.allreduce_timeout + 1.0
            group_info = self._wait_for_round(maybe_step_control, bound)
            if not isinstance(group_info, AbortedRound):
                self._load_averaged_gradients_into_optimizer_()
        except BaseException as e:  # TimeoutError: the all-reduce's bound, or this wait's, ran out
            group_info = AbortedRound(repr(e), ran_out=isinstance(e, TimeoutError),
                                      behind=isinstance(e, BehindTheSwarm))
        if not maybe_step_control.done():
            maybe_step_control.cancel()
        if getattr(self.grad_averager, "grads_averaged_in_place", False):
            # the round averages .grad itself (node.swarm.commit): one still running holds the averager's lock
            # until it ends, and no later write of it may land on the gradient loaded below
            with self.grad_averager.lock_averaged_tensors:
                pass
        if isinstance(group_info, AbortedRound):
            reason = group_info.reason + self._ran_out(group_info)
            self._no_round_alone(reason, behind=group_info.behind)
            logger.info(f"Gradient averaging failed ({reason}): this update uses this peer's own gradient")
            self._load_local_gradients_into_optimizer()
            return
        self._measured(len(group_info))
        logger.info(f"Averaged gradients with {len(group_info)} peers")
        self._round_group = tuple(sorted(str(peer) for peer in group_info))
        self._round_clean = True

    def _wait_for_round(self, control, bound: float):
        """The round's result, within `bound` seconds. The tracker reads no progress while an update runs (hivemind
        holds its lock for the update), so meanwhile the swarm's epoch is read here, every SWARM_EPOCH_EVERY_S, for
        the averager to end a round still looking for a group at an older one (node.swarm.groupsize)."""
        deadline = time.monotonic() + bound
        while True:
            try:
                return control.result(max(0.0, min(deadline - time.monotonic(), SWARM_EPOCH_EVERY_S)))
            except TimeoutError:
                if control.done() or time.monotonic() >= deadline:
                    raise  # the round's own error, or this wait's bound
            epoch = self.read_swarm_epoch()
            if epoch is not None:
                self._swarm_at(epoch)

    def read_swarm_epoch(self) -> Optional[int]:
        """The latest epoch in the full peers' progress records (hivemind's global epoch), read now (bounded by
        SWARM_EPOCH_EVERY_S), or None. The tracker's own view can be a minute old after a download filled the link."""
        try:
            found = self.dht.get(self.tracker.training_progress_key, latest=True, return_future=True)
            found = found.result(SWARM_EPOCH_EVERY_S)
            records = found.value.values() if found is not None and isinstance(found.value, dict) else ()
            epochs = [LocalTrainingProgress.parse_obj(r.value) for r in records if r.value is not None]
        except Exception as e:  # no answer, or a record that is not a progress record: the next read may do
            logger.debug(f"Reading the swarm's progress failed: {e!r}")
            return None
        return max((p.epoch for p in epochs if not p.client_mode), default=None)

    def _measured(self, peers: int) -> None:
        """A committed round: its exchange's throughput goes into the next round's deadline."""
        exchanges = getattr(self.grad_averager, "exchanges", None)
        if self.round_clock is None or exchanges is None:
            return
        count, exchange_s = exchanges.read()
        if count != self._exchanges_seen:
            self._exchanges_seen = count
            self.retime(self.round_clock.completed(peers, exchange_s))

    def _ran_out(self, aborted: AbortedRound) -> str:
        """For the log line of an aborted round that ran out of time: why its deadline was what it was (the next
        one is longer)."""
        if self.round_clock is None or not aborted.ran_out:
            return ""
        spent, longer = self.round_clock.ran_out()
        self.retime(longer)
        return f"; out of time: its deadline was {spent.seconds:.0f}s, from {spent.why}"

    def retime(self, deadline: Optional[Deadline]) -> None:
        """The next rounds' deadline on every bound that depends on it (node.swarm.deadlines); None: as it is."""
        if deadline is None:
            return
        self.averaging_timeout = self.allreduce_timeout = deadline.seconds
        self.next_chunk_timeout = chunk_timeout(deadline.seconds)
        for averager in (self.grad_averager, self.state_averager):
            if isinstance(averager, Retimable):
                try:
                    averager.set_allreduce_timeout(deadline.seconds, self.next_chunk_timeout)
                except Exception as e:  # its next round keeps the old bound; the node goes on
                    logger.warning(f"{type(averager).__name__} did not take the new deadline: {e!r}")

    # Pre-scheduled rounds only with company. hivemind starts matchmaking for the next round ahead of it, and cancels
    # that round when the peer turns out to be alone at its update: a node alone schedules and cancels one per update.
    # A cancel that lands while matchmaking is asking a newly arrived peer to lead kills the averager's declaring task
    # ("Task was destroyed but it is pending", "aclose(): asynchronous generator is already running"), and that
    # averager finds no group in any later round. Scheduled only when the tracker sees other peers, a round is
    # cancelled only if they leave in between.
    def _maybe_schedule_gradient_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            self._expect_group()
            super()._maybe_schedule_gradient_averaging()

    def _expect_group(self) -> None:
        """Low-comm: the next round's group closes once the peers at the swarm's epoch are in it
        (node.swarm.groupsize), when this peer brings samples to it. A peer with none (a full peer that joins for
        client-mode peers' sake) keeps hivemind's window: two such peers leading a group that closed without the
        clients whose samples the round is for would average weights of zero (0/0). Per-step keeps the window too: it
        is the gathering window in which a packet that reaches another node joins the same update
        (docs/architecture.md, "When the swarm updates")."""
        if self._round_due is not None and isinstance(self.grad_averager, ExpectedGroup):
            has_samples = self.grad_averager.local_samples_accumulated > 0
            self.grad_averager.expect_group(self.tracker.global_progress.num_peers if has_samples else 0)

    def _maybe_schedule_state_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_state_averaging()

    def _update_global_epoch(self, grad_scaler) -> None:
        if self.tracker.global_epoch > self.local_epoch:
            # Behind the swarm. hivemind would let this peer update anyway, joining whatever gradient round the
            # others gather next with a gradient of parameters they have left, and label the result with an epoch
            # whose bytes the others made: its gradient was then applied in their update and, having lost the
            # agreement, carried into a later one too. The node catches up first (SwarmFollower.catch_up) and
            # joins the swarm's next round with its gradient intact.
            return
        epoch = self.local_epoch
        try:
            super()._update_global_epoch(grad_scaler)
        except NoSwarmRound as e:
            self.skipped_rounds += 1
            self.grad_averager.notify_used_averaged_gradients()  # nothing of it is used: hivemind's next round warns
            self._others.reach_now()
            if isinstance(self.tracker, PacedTracker):
                self.tracker.read_before_next_round()
            if time.monotonic() >= self._next_skip_log:  # a client-mode peer left alone retries every poll
                self._next_skip_log = time.monotonic() + SKIP_LOG_EVERY_S
                logger.info(f"{e}; {self.skipped_rounds} such rounds so far")
            return
        self.last_round = RoundOutcome(epoch=self.local_epoch, group=self._round_group, clean=self._round_clean)
        if isinstance(self.tracker, PacedTracker):  # whom it counted and went without (a peer that left, or late)
            self.tracker.round_went(epoch, self._round_group)
        if not self.client_mode:
            self.state_averager.state_sharing_priority = self.local_epoch + update_bonus(
                self._update_bonus, clean=self._round_clean)


def peer_bonus(peer_id: str) -> float:
    """A per-peer number in [0, 1): peers that made the same kind of update are ranked by it."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") / 2 ** 32


def update_bonus(bonus: float, clean: bool) -> float:
    """A peer's state-sharing priority above its epoch after an update, in (0, 1).

    With a complete gradient round: [0.7, 0.99). After a failed round (its own gradient only): [0.4, 0.69). A peer
    that only caught up has its bare epoch. The reference of an epoch, whose bytes every peer serves, is its peer of
    highest priority: a complete round's over a failed one's, distinct per peer.
    """
    return (0.7 if clean else 0.4) + 0.29 * bonus
