"""The node's hold on the hivemind swarm: its DHT and the collaborative optimizer around the model's AdamW.

`Swarm` owns both and their shutdown, and decides at start whether the node joins as a full peer or, when the swarm
cannot dial it, as a client-mode peer (node.swarm.reachability). `SwarmOptimizer` is hivemind.Optimizer with five
changes the node relies on: a gradient round is applied whole or not at all (node.commit), it applies the node's
exact gradient whenever the swarm's average is unavailable, a client-mode peer never updates without the swarm's
average, it reports each update's outcome (which peers' gradients went into it), and an update also begins when the
swarm's pending samples stop growing, so a swarm keeps its pace when a peer leaves whatever target it was started
with.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Sequence

import hivemind
import torch
from hivemind.optim.progress_tracker import GlobalTrainingProgress, LocalTrainingProgress, ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

from dtrain.node import memory
from dtrain.node.lowcomm import codec as lowcomm_codec
from dtrain.node.lowcomm.gather import SparseGatherAverager
from dtrain.node.lowcomm.deadline import Deadline
from dtrain.node.swarm.commit import AbortedRound, CommittingGradientAverager, chunk_timeout
from dtrain.node.swarm.deadlines import Retimable, RoundClock
from dtrain.node.swarm.keygate import start_prover
from dtrain.node.swarm.presence import presence_validator
from dtrain.node.swarm.records import RecordOwner, identity_kwargs
from dtrain.node.swarm.swarmkey import SwarmJoinError, SwarmKeyAuthorizer, keyed_run_id, load_swarm_key
from dtrain.node.swarm.reachability import Reachability, ReachabilityService, decide
from dtrain.node.swarm.service import NodeService
from dtrain.node.swarm.state import SwarmStateAverager, keep_state_shared
from dtrain.node.config import SwarmConfig, TrainConfig

logger = get_logger(__name__)

# the tracker looks for fresh swarm progress at least this often: it bounds how far apart peers begin an update
TRACKER_MAX_REFRESH_S = 1.0
NEVER = 2 ** 31 - 1  # average_state_every that never comes: the sparse codec's outer steps agree to the bit
SKIP_LOG_EVERY_S = 10.0  # at most one log line this often for rounds that made no update
SHUTDOWN_TIMEOUT_S = 5.0  # how long hivemind may take to leave the swarm when stopped under an update


@dataclass(frozen=True)
class RoundOutcome:
    """Whose gradients one update of this peer applied."""

    epoch: int  # the epoch the update made
    group: tuple[str, ...]  # peer ids whose gradients were averaged (this peer alone when it used its own)
    clean: bool  # the gradient round completed on this peer (or it was alone): its gradient is in the average


class NoSwarmRound(Exception):
    """A client-mode peer's gradient round did not complete: it makes no update (SwarmOptimizer)."""


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups as GPT-2 is trained (nanoGPT's rule): weight decay on the matrices (embeddings,
    attention and MLP weights), none on biases and LayerNorm weights (every tensor of fewer than 2 dimensions).

    The groups are runs of consecutive parameters, so flattening them gives `model.parameters()`'s order: the order
    of the manifest, of the gradients the node computes, and of hivemind's averaged tensors."""
    groups: list[dict] = []
    for param in model.parameters():
        decay = weight_decay if param.dim() >= 2 else 0.0
        if groups and groups[-1]["weight_decay"] == decay:
            groups[-1]["params"].append(param)
        else:
            groups.append({"params": [param], "weight_decay": decay})
    return groups


def regroup_state_dict(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer state_dict saved with other parameter groups (a checkpoint from before decay_groups), laid out
    as `optimizer`'s: per-parameter state is keyed by the flat parameter index, which the layouts share."""
    flat = [i for group in saved["param_groups"] for i in group["params"]]
    ours = [p for group in optimizer.param_groups for p in group["params"]]
    if len(flat) != len(ours):
        raise ValueError(f"the saved optimizer state holds {len(flat)} parameters, the model {len(ours)}")
    groups, start = [], 0
    for group in optimizer.param_groups:
        end = start + len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": flat[start:end]})
        start = end
    return {"state": saved["state"], "param_groups": groups}


def make_local_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(
        decay_groups(model, train.weight_decay),
        lr=train.learning_rate,
        betas=(train.beta1, train.beta2),
        eps=train.eps,
    )
    # Give AdamW its (empty) state now. hivemind otherwise creates it with a zero-gradient optimizer step, which
    # applies weight decay to the seeded weights and starts Adam's bias correction one step late. In shared memory
    # from the start (node.memory): no page is taken until the first update, or a download, writes it.
    for group in optimizer.param_groups:
        for p in group["params"]:
            zeros = (lambda: memory.shared_zeros(p.numel()).view_as(p)) if p.device.type == "cpu" and \
                p.dtype == torch.float32 else (lambda: torch.zeros_like(p, memory_format=torch.preserve_format))
            optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": zeros(), "exp_avg_sq": zeros()}
    return optimizer


class PacedTracker(ProgressTracker):
    """hivemind's tracker with the swarm's own rule for when an update begins (docs/architecture.md, "When the swarm updates").

    An update begins when the swarm moved to a later epoch, when the swarm's pending samples reach the target, or
    once they stopped growing for `settle_s`. Two of hivemind's rules are left out:
    - its estimate of when the target will be reached. It extrapolates each peer's samples per second, which a
      bridge's bursts of packets make meaningless: a node that took 4 samples in 10 ms expected the rest at once and
      updated alone while its peer's packet was still on the way;
    - reaching the target while this peer's view of the swarm's progress shows no one else although other nodes
      announced themselves (a node that joined or just received its first packet has not read their progress yet).
      Then the settle rule decides, which waits long enough for the progress of every peer to be read.
    """

    def __init__(self, *args, settle_s: float, **kwargs):
        self.settle_s = settle_s
        # whether other nodes announced themselves: set by the node once it knows who is in the swarm; a swarm
        # without announcements (the adapter's, node.serve.adapter) sets it to always true
        self.others_present: Callable[[], bool] = lambda: False
        # low-communication mode: the node's own rule (its inner updates are done, or it is alone) replaces the
        # target and the settle rule; then this peer's round begins once the swarm's samples stopped growing
        self.round_due: Optional[Callable[[], bool]] = None
        self._seen_samples, self._grew_at = 0, time.monotonic()
        super().__init__(*args, **kwargs)

    @property
    def ready_to_update_epoch(self) -> bool:
        if self.global_epoch > self.local_progress.epoch:
            return True
        progress = self.global_progress
        samples = progress.samples_accumulated
        if samples != self._seen_samples:
            self._seen_samples, self._grew_at = samples, time.monotonic()
        if self.round_due is not None:
            # every node stops its inner updates when they are done: once the swarm's samples stop growing, every
            # node in it is waiting for this round (a node that left stops counting when its record expires)
            return self.round_due() and (not self.others_present() or time.monotonic() - self._grew_at >= self.settle_s)
        if samples >= self.target_batch_size and (progress.num_peers > 1 or not self.others_present()):
            return True
        return samples > 0 and time.monotonic() - self._grew_at >= self.settle_s

    def _parse_swarm_progress_data(self, metadata) -> GlobalTrainingProgress:
        progress = super()._parse_swarm_progress_data(metadata)
        if isinstance(metadata, dict) and metadata:
            # a peer behind the swarm's epoch is downloading its state or replaying the rounds it missed: it is in no
            # round of this epoch. Counted, it made this peer's round look for a group it never joined
            entries = [LocalTrainingProgress.parse_obj(v.value) for v in metadata.values() if v.value is not None]
            current = [p for p in entries if p.epoch >= progress.epoch]
            progress.num_peers, progress.num_clients = len(current), sum(p.client_mode for p in current)
        return progress

    @property
    def estimated_next_update_time(self) -> float:
        # no estimate, so hivemind never pre-schedules a round for a time the bridge's traffic cannot promise
        return get_dht_time() if self.ready_to_update_epoch else float("inf")


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
                 settle_s: float, swarm_key: Optional[bytes] = None, **kwargs):
        self._local_gradients = local_gradients
        self._swarm_key = swarm_key  # a closed swarm: the state averager's RPCs answer only holders of the key
        self._update_bonus = update_bonus  # added to the epoch as this peer's state-sharing priority after an update
        self._settle_s = settle_s
        self.last_round: Optional[RoundOutcome] = None
        self._round_group: tuple[str, ...] = ()
        self._round_clean = False
        self.skipped_rounds = 0  # rounds that failed with no gradient this peer could apply alone: no update
        self._round_samples = 0  # samples this peer brought to the round being run
        self._next_skip_log = 0.0
        # called with .grad holding what an update is about to apply (averaged, or this peer's own)
        self.before_update: Optional[Callable[[], None]] = None
        self.on_state_loaded: Optional[Callable[[], None]] = None  # called after every download of the state
        # called before every download of the state, which replaces the parameters (low-comm: the node sets the
        # inner updates' parameters aside, node.lowcomm.rounds.InnerRounds.enter_outer)
        self.before_state_load: Optional[Callable[[], None]] = None
        self.node_catches_up = False  # the node brings a peer behind the swarm up to date itself (never step())
        # each gradient round's measured exchange (or its running out of time) sets the next one's deadline
        self.round_clock: Optional[RoundClock] = None
        self._exchanges_seen = 0
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

    def _no_round_alone(self, reason: str) -> None:
        # A client-mode peer never updates alone (see the class docstring); nor does a full peer that only joined
        # the round for client-mode peers' sake (no samples of its own): alone, its update would be Adam's
        # momentum and weight decay, asked for by no one
        if self.client_mode or self._round_samples == 0:
            raise NoSwarmRound(reason)

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return PacedTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                             client_mode=self.client_mode, status_loglevel=self.status_loglevel, start=True,
                             settle_s=self._settle_s, **kwargs)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

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
            self.scheduled_grads = self.grad_averager.schedule_step(timeout=self.averaging_timeout)
        began = super()._begin_averaging_gradients(grad_scaler)
        if not began:
            self._no_round_alone("the gradient round could not begin")
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
        if self.on_state_loaded is not None:
            self.on_state_loaded()

    def _load_round_gradients(self, maybe_step_control) -> None:
        """.grad for the update: the round's average, or this peer's exact gradient (or NoSwarmRound)."""
        if maybe_step_control is None:
            self._no_round_alone("no other peer in the swarm's progress")
            self._round_clean = True  # "no other peers": this peer's gradient is the whole update
            self._load_exact_local_gradients()
            self.grad_averager.notify_used_averaged_gradients()
            return
        try:
            # the averager decides within its deadline (matchmaking) plus one all-reduce with its commit step: waiting
            # longer than that, this peer never uses its own gradient while the others apply a round it committed
            bound = max(0.0, maybe_step_control.deadline - get_dht_time()) + self.allreduce_timeout + 1.0
            group_info = maybe_step_control.result(bound)
            if not isinstance(group_info, AbortedRound):
                self._load_averaged_gradients_into_optimizer_()
        except BaseException as e:  # TimeoutError: the all-reduce's bound, or this wait's, ran out
            group_info = AbortedRound(repr(e), ran_out=isinstance(e, TimeoutError))
        if not maybe_step_control.done():
            maybe_step_control.cancel()
        if getattr(self.grad_averager, "grads_averaged_in_place", False):
            # the round averages .grad itself (node.swarm.commit): one still running holds the averager's lock
            # until it ends, and no later write of it may land on the gradient loaded below
            with self.grad_averager.lock_averaged_tensors:
                pass
        if isinstance(group_info, AbortedRound):
            reason = group_info.reason + self._ran_out(group_info)
            self._no_round_alone(reason)
            logger.info(f"Gradient averaging failed ({reason}): this update uses this peer's own gradient")
            self._load_local_gradients_into_optimizer()
            return
        self._measured(len(group_info))
        logger.info(f"Averaged gradients with {len(group_info)} peers")
        self._round_group = tuple(sorted(str(peer) for peer in group_info))
        self._round_clean = True

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
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_state_averaging()

    def _update_global_epoch(self, grad_scaler) -> None:
        if self.tracker.global_epoch > self.local_epoch:
            # Behind the swarm. hivemind would let this peer update anyway, joining whatever gradient round the
            # others gather next with a gradient of parameters they have left, and label the result with an epoch
            # whose bytes the others made: its gradient was then applied in their update and, having lost the
            # agreement, carried into a later one too. The node catches up first (TrainingNode._catch_up) and
            # joins the swarm's next round with its gradient intact.
            return
        try:
            super()._update_global_epoch(grad_scaler)
        except NoSwarmRound as e:
            self.skipped_rounds += 1
            if time.monotonic() >= self._next_skip_log:  # a client-mode peer left alone retries every poll
                self._next_skip_log = time.monotonic() + SKIP_LOG_EVERY_S
                logger.info(f"Gradient round failed ({e}): no update alone"
                            + (" (client mode); this peer's gradient waits for the swarm's next round"
                               if self.client_mode else " (no samples of its own)")
                            + f"; {self.skipped_rounds} such rounds so far")
            return
        self.last_round = RoundOutcome(epoch=self.local_epoch, group=self._round_group, clean=self._round_clean)
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


@contextlib.contextmanager
def _closed_join(closed: bool):
    """In a closed swarm, hivemind's "bootstrap failed" also means that the initial peers hold another key: say so."""
    try:
        yield
    except RuntimeError as e:
        if closed and "bootstrap failed" in str(e):
            raise SwarmJoinError(f"{e}: in a closed swarm, none of the initial peers answered with this --swarm-key "
                                 f"(they are unreachable, or hold another key or none)") from None
        raise


class Swarm:
    """The DHT and the collaborative optimizer of one node, and their bounded shutdown."""

    def __init__(self, config: SwarmConfig, local_optimizer: torch.optim.Optimizer,
                 local_gradients: Callable[[], Sequence[torch.Tensor]], verbose: bool = False,
                 low_comm: bool = False, round_clock: Optional[RoundClock] = None):
        """`round_clock`: keeps the all-reduce deadline from each round's measured throughput (node.swarm.deadlines);
        None: `config.averaging_timeout_s` throughout."""
        self.config = config
        # a closed swarm: the key is read (or refused) before anything starts; the run's DHT keys are then named
        # with it, and every DHT request and response carries its HMAC (node.swarm.swarmkey)
        swarm_key = load_swarm_key(config.swarm_key_path) if config.swarm_key_path is not None else None
        self.run_id = keyed_run_id(swarm_key, config.run_id) if swarm_key else config.run_id
        self.closed = swarm_key is not None
        identity_path = config.identity_path
        if identity_path and not os.path.exists(identity_path):
            P2P.generate_identity(identity_path)  # a stable peer id across restarts
            logger.info(f"Generated a new libp2p identity in {identity_path}")
        # the node's records are signed with its libp2p identity, so a record's subkey names its peer
        # (node.swarm.records); without --identity-path a fresh one is made for this run
        self.owner = RecordOwner.from_identity(identity_path) if identity_path else RecordOwner.generate()
        # asked before the DHT starts: hivemind's client mode is chosen when a peer is created
        self.reachability: Reachability = decide(config.reachability, config.relay, config.initial_peers,
                                                 config.host_maddrs, config.announce_maddrs, swarm_key=swarm_key)
        logger.info(self.reachability.describe())
        client = self.reachability.mode == "client"
        keep_state_shared(local_optimizer)  # before hivemind forks its first process, and can hand the state out
        memory.trim()  # what the moves to shared memory freed is not inherited by the forks either
        with identity_kwargs(self.owner, identity_path) as identity, _closed_join(self.closed):
            self.dht = hivemind.DHT(
                initial_peers=list(config.initial_peers),
                host_maddrs=list(config.host_maddrs),
                announce_maddrs=list(config.announce_maddrs) or None,
                client_mode=client,
                use_relay=config.relay,
                use_auto_relay=config.relay and client,
                record_validators=[self.owner.validator, presence_validator(self.run_id)],
                authorizer=SwarmKeyAuthorizer(swarm_key) if swarm_key else None,
                start=True,
                **identity,
            )
        self.optimizer: Optional[SwarmOptimizer] = None
        self.service: Optional[NodeService] = None
        self._shut_down = threading.Event()
        try:
            if swarm_key:  # answer the challenges of peers' gated RPCs (node.swarm.keygate)
                start_prover(self.dht, swarm_key)
            # the node's own RPCs; a client-mode peer is asked no dial-back: nobody can dial it
            self.service = NodeService(self.dht, swarm_key) if client else ReachabilityService(self.dht, swarm_key)
            self.peer_id = str(self.dht.peer_id)
            if self.peer_id != self.owner.peer_id:  # records would name another peer than the one that wrote them
                raise RuntimeError(f"p2pd runs as {self.peer_id}, not as the record key's peer {self.owner.peer_id}")
            self.maddrs = [str(addr) for addr in self.dht.get_visible_maddrs()]
            # Every node applies the same averaged update: gradients are all-reduced, then parameters and Adam
            # moments (delay_state_averaging=False keeps state averaging inside the update). In low-communication
            # mode the "gradient" is the pseudo-gradient, compressed on the wire, the optimizer is the outer
            # Nesterov step, and only the parameters are averaged after it; the outer momentum is each node's own,
            # built from the same averaged pseudo-gradients.
            low = dict(grad_compression=lowcomm_codec.compression(config.wire_codec),
                       average_opt_statistics=()) if low_comm else dict(average_opt_statistics=("exp_avg", "exp_avg_sq"))
            averager = partial(CommittingGradientAverager, record_subkey=self.owner.subkey, swarm_key=swarm_key)
            if low_comm and config.wire_codec == "sparse":
                # every member computes the same average from the same payloads (node.lowcomm.gather), so the
                # outer step gives the same bits everywhere: no parameter averaging after it
                averager = partial(SparseGatherAverager, record_subkey=self.owner.subkey, swarm_key=swarm_key,
                                   fraction=config.topk_fraction)
                low["average_state_every"] = NEVER
            self.optimizer = SwarmOptimizer(
                local_gradients=local_gradients,
                update_bonus=peer_bonus(self.peer_id),
                swarm_key=swarm_key,
                settle_s=config.settle_s,
                dht=self.dht,
                run_id=self.run_id,
                target_batch_size=config.target_batch_size,
                optimizer=local_optimizer,
                matchmaking_time=config.matchmaking_time_s,
                averaging_timeout=config.averaging_timeout_s,
                next_chunk_timeout=chunk_timeout(config.averaging_timeout_s),  # also bounds a state download's chunks
                load_state_timeout=config.load_state_timeout_s,
                delay_state_averaging=False,
                client_mode=client,  # hivemind 1.1.12 takes the DHT's mode when this is given at all
                reuse_grad_buffers=True,  # the node writes the exact samples-weighted gradient into .grad itself
                # a gradient round is applied whole or not at all; members' outcomes are signed records
                grad_averager_factory=averager,
                **{"average_state_every": 1, **low},
                averager_opts=dict(request_timeout=config.request_timeout_s),
                # the tracker signs its progress records with the DHT's one record key (hivemind keeps the first
                # RSASignatureValidator a DHT is given and ignores later ones)
                tracker_opts=dict(min_refresh_period=0.2, max_refresh_period=TRACKER_MAX_REFRESH_S,
                                  default_refresh_period=0.5, private_key=self.owner.private_key),
                verbose=verbose,
            )
            self.optimizer.round_clock = round_clock
        except BaseException:
            self.shutdown()
            raise

    @property
    def client_mode(self) -> bool:
        return self.reachability.mode == "client"

    @property
    def epoch(self) -> int:
        return self.optimizer.local_epoch

    def wait_for_progress(self, timeout_s: float) -> bool:
        """Bounded wait for the tracker's first look at the swarm's progress (so global_epoch is real)."""
        return self.optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout_s)

    def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """Idempotent: the training thread and a stopping main thread may both call it.

        hivemind's own shutdown waits on an all-reduce in flight and then on each process's grace period in turn
        (more than 15 s seen here). With `timeout_s` it gets that long; then hivemind's processes still alive are
        terminated, which is what hivemind itself does when a grace period runs out.
        """
        if timeout_s is None:
            self._shut_down_once()
            return
        deadline = time.monotonic() + timeout_s
        threading.Thread(target=self._shut_down_once, name="dtrain-shutdown", daemon=True).start()
        averagers = (getattr(self.optimizer, "grad_averager", None), getattr(self.optimizer, "state_averager", None))
        processes = [p for p in (*averagers, self.dht) if p is not None]
        # wait for the processes, not the thread: another thread may be inside the graceful shutdown already
        while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        for process in processes:
            if process.is_alive():
                logger.warning(f"{type(process).__name__} did not shut down within {timeout_s:.0f}s; terminating it")
                process.terminate()

    def _shut_down_once(self) -> None:
        if self._shut_down.is_set():
            return
        self._shut_down.set()
        for part in (self.service, self.optimizer, self.dht):  # the DHT last: it also stops the p2pd child process
            if part is None:
                continue
            try:
                part.shutdown()
            except Exception as e:
                logger.warning(f"Shutting down {type(part).__name__} failed: {e!r}")
