"""The node core: the model, the training thread and the thread-safe interface the bridge calls.

Every call into hivemind happens on one thread owned by `TrainingNode`. Its iterations are one loop's, per sync
mode: node.train.low_comm.LowCommLoop (inner updates, then an outer round) or node.train.per_step.PerStepLoop (an
averaged update per step). Both run on the parts the node composes:
- `ContributionPool` (train.pool): contributions accepted from the bridge, in groups of `min_nodes_for_update`, and
  `Intake` (train.intake): a group robustly aggregated into the pending gradient;
- `PendingGradient` (train.gradient): what this node gathered that no update applied yet, carried until one does;
- `Compute` (train.compute): forward and backward passes of a batch of the node's own data, on its device;
- `Swarm` (swarm.swarm): the DHT and hivemind.Optimizer; `Presence` (swarm.presence): who is in the swarm;
- `Agreement` (swarm.agreement): which bytes every peer serves after an update, and whose gradients are in them;
- `StepPublisher` (train.publication): a served step's digest, snapshot, records and log line, once per step;
- `SwarmFollower` (train.follow): the swarm's state taken at the join, and again whenever the node falls behind.
The node itself joins the swarm (and says where its first state came from) and saves checkpoints.

Other threads only call `submit(contribution)`, `snapshot()`, `losses()` and `status()`.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import numpy as np
import torch
from hivemind.utils.logging import get_logger

from dtrain.node import checkpoint as ckpt
from dtrain.node import memory
from dtrain.node.swarm.agreement import Agreement, Download
from dtrain.node.swarm.contact import Contact
from dtrain.node.config import ConfigError, ModelConfig, NodeConfig, TrainConfig
from dtrain.node.contribution import Contribution
from dtrain.node.data import TokenDataset
from dtrain.node.device import resolve as resolve_device, threads_now
from dtrain.node.lowcomm import codec as lowcomm_codec
from dtrain.node.lowcomm.outer import OuterNesterov
from dtrain.node.lowcomm.ranges import StateLayout
from dtrain.node.lowcomm.rounds import InnerRounds
from dtrain.node.lowcomm.roundlog import CatchUp
from dtrain.node.lowcomm.statefetch import RangeDonor
from dtrain.node.train.compute import Batch, Compute, OwnBatches
from dtrain.node.train.adamw import make_local_optimizer, regroup_state_dict
from dtrain.node.train.ahead import Ahead
from dtrain.node.train.gradient import PendingGradient
from dtrain.node.train.intake import Intake
from dtrain.node.train.low_comm import LowCommLoop
from dtrain.node.train.follow import SwarmFollower
from dtrain.node.train.per_step import PerStepLoop
from dtrain.node.train.publication import StepPublisher
from dtrain.node.train.status import NodeStatus
from dtrain.node.train.ledger import ContributorLedger, ScoringConfig
from dtrain.node.hfdir import load_params
from dtrain.node.model import TensorInfo, build_model, tensor_infos
from dtrain.node.train.pool import ContributionPool
from dtrain.node.swarm.others import Others
from dtrain.node.swarm.presence import ANNOUNCE_EVERY_S, Presence
from dtrain.node.train.reference import ReferenceConfig, ReferenceSource
from dtrain.node.train.robust import RobustAggregator, RobustConfig
from dtrain.node.snapshot import Snapshot, make_snapshot, params_digest
from dtrain.node.swarm.deadlines import RoundClock, per_step_sizes, swarm_deadlines
from dtrain.node.swarm.state import SwarmStateAverager, keep_state_shared
from dtrain.node.swarm.swarm import SHUTDOWN_TIMEOUT_S, Averaging, Swarm

logger = get_logger(__name__)

POLL_S = 0.25  # how long an idle training thread sleeps unless a hand-over wakes it
# how long a joiner of a swarm at epoch 0 looks for the peers' record of its start before it downloads it: the
# founder's is in the DHT from its start and refreshed every few seconds (node.swarm.agreement.KEEP_ALIVE_S)
START_RECORD_WAIT_S = 10.0
# low-comm on a GPU: the least time between served steps (--min-round-seconds). A browser that needs seconds for a
# packet stays inside the late window of five steps, and the outer round's work on the host (about a second for
# GPT-2 small on an H200, where 5 s rounds held the node at 0.6x a plain loop) is a small part of each round. GPT-2
# small at 8x64 makes about 400 inner updates in it, GPT-2 XL at 8x512 about 70: DiLoCo runs use H = 100-500
DEFAULT_MIN_ROUND_S_GPU = 15.0
TRIM_EVERY_S = 30.0  # how often the heap's free pages go back besides each served step (node.memory)


class NodeStopped(RuntimeError):
    pass


class TrainingNode:
    """One node of the swarm: owns the model and the training thread."""

    def __init__(self, config: NodeConfig, model_config: ModelConfig, train_config: TrainConfig,
                 dataset: Optional[TokenDataset] = None, ledger: Optional[ContributorLedger] = None,
                 reference_data: Optional[TokenDataset] = None, init_params: Optional[dict] = None,
                 resident: Optional[bool] = None):
        """`reference_data`: the node's own text for the trusted reference (train/reference.py), `dataset` or the
        packaged corpus; None (or --reference-batch 0): no reference. `init_params`: the weights a new swarm starts
        from (--init-from) instead of the seeded ones; a joiner takes the swarm's state whatever it started with.
        `resident`: a low-comm node's inner loop trains its own copy of the model on the device (parameters,
        gradients, AdamW state), and the master takes its values once per outer round (node.lowcomm.rounds); None:
        on a GPU, or with --inner-copy. On the CPU it is the same code over a second copy in memory."""
        self.config, self.model_config, self.train_config = config, model_config, train_config
        self.dataset = dataset
        self.device = resolve_device(config.device)  # ConfigError before anything starts
        self.model = build_model(model_config)  # the fp32 master: CPU, shared with hivemind (docs/NOTES.md, "Device")
        if init_params is not None:
            load_params(self.model, init_params)
        self.compute = Compute(self.model, self.device)  # forward and backward passes, on the device
        self.tensors: tuple[TensorInfo, ...] = tensor_infos(self.model)
        self.total_params = sum(t.elements for t in self.tensors)
        self.pool = ContributionPool(train_config.min_nodes_for_update, lambda: self.step, config.max_pending_bytes)
        self.gradient = PendingGradient([t.elements for t in self.tensors])
        self.reference: Optional[ReferenceSource] = None
        if reference_data is not None and config.reference_batch > 0:
            self.reference = ReferenceSource(self.compute, reference_data,
                                             ReferenceConfig(config.reference_batch, config.local_seq_len),
                                             model_config.max_seq_len)
        # with a trusted reference the direction check is on by default (FLTrust's ReLU gate: cosine > 0)
        min_cosine = config.min_cosine if config.min_cosine is not None or self.reference is None else 0.0
        robust = RobustConfig(method=config.aggregation, norm_bound=config.norm_bound,
                              max_samples=config.max_samples_per_packet, min_cosine=min_cosine,
                              max_weight_multiple=config.max_weight_multiple)
        self.aggregator = RobustAggregator(robust, [t.elements for t in self.tensors])
        self.ledger = ledger if ledger is not None else ContributorLedger(
            scoring=ScoringConfig(enabled=config.contributor_scoring))
        self.low_comm = config.swarm.sync == "low-comm"
        self.resident = self.low_comm and (resident if resident is not None else
                                           self.device.is_cuda or config.swarm.inner_copy)
        # the all-reduce deadline: sized for the bytes of a round, kept from each round's measured throughput
        sizes = (lowcomm_codec.round_sizes(config.swarm, self.total_params) if self.low_comm
                 else per_step_sizes(self.total_params))
        self.swarm_config, deadlines = swarm_deadlines(config.swarm, self.total_params, sizes)
        self.round_clock = RoundClock(deadlines, sizes)
        self.intake = Intake(self.aggregator, self.ledger, self.gradient, [t.elements for t in self.tensors],
                             lambda: self.step, self.reference, optimizer=self._inner_optimizer)
        self.loop = LowCommLoop(self) if self.low_comm else PerStepLoop(self)  # the training thread's iterations
        self.rounds: Optional[InnerRounds] = None  # low-comm: this node's inner updates since the last outer round
        self.ahead: Optional[Ahead] = None  # low-comm with --train-data: local batches trained during a round
        self.catchup: Optional[CatchUp] = None  # sparse codec: the round log, and catching up by replaying it
        self.donor: Optional[RangeDonor] = None  # sparse codec, --state-donors: serves ranges of the served state
        self.swarm: Optional[Swarm] = None
        self.presence: Optional[Presence] = None
        self.contact: Optional[Contact] = None  # the peers it trained with, reached again (node.swarm.contact)
        self.others = Others()  # both, as the optimizer reads them
        self.agreement: Optional[Agreement] = None
        self.publisher: Optional[StepPublisher] = None  # the served step, from the end of the join on
        self._stop = threading.Event()
        self.follower = SwarmFollower(self, self._stop)  # takes the swarm's state: at the join, and when behind

        self._losses: list[float] = []  # a restored checkpoint's, until the publisher holds them
        self._snapshot_listeners: list[Callable[[Snapshot], None]] = []
        self._update_listeners: list[Callable[[float], None]] = []
        self._last_checkpoint_epoch = 0
        self._first_state = ""  # how the state of its first served step came (NodeStatus.first_state)
        self.unverified = False  # the model holds downloaded bytes the swarm disagrees with: catch up, never serve
        self._next_trim = time.monotonic() + TRIM_EVERY_S
        self._wake = threading.Event()  # set by the pool when a hand-over is ready
        self.pool.on_ready(self._wake.set)
        self.batches: Optional[OwnBatches] = None  # --train-data: the node's own batches, from its join on
        self._peers_arrived = config.wait_for_peers <= 1  # --wait-for-peers: local training may start
        self._next_wait_log = 0.0
        self._thread = threading.Thread(target=self._run, name="dtrain-training", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Join (or start) the swarm and catch up, then start the training thread; returns once it may serve.

        Call it from the main thread: hivemind's averagers install signal handlers when they are created.
        """
        try:
            self._join()
        except BaseException:
            if self.contact is not None:
                self.contact.stop()
            if self.swarm is not None:
                self.swarm.shutdown()
            raise
        memory.reuse_freed_blocks()  # hivemind's processes are forked: from here on, passes reuse their blocks
        self._thread.start()

    def stop(self, grace_s: float = 3.0) -> None:
        """Stop training; the thread saves a checkpoint and leaves the swarm.

        An all-reduce in flight can take up to averaging_timeout; past `grace_s` the swarm connection is shut
        down under it (the checkpoint from the last completed interval stands) so the process exits promptly.
        """
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(grace_s)
        if self._thread.is_alive() and self.swarm is not None:
            logger.warning("An update is still in flight; leaving the swarm without waiting for it")
            self.swarm.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S)
            self._thread.join(2.0)
        if self.publisher is not None:
            self.publisher.background.close()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def add_update_listener(self, callback: Callable[[float], None]) -> None:
        """Called on the training thread with the seconds each update of this node took, until it served it."""
        self._update_listeners.append(callback)
        if self.publisher is not None:
            self.publisher.add_update_listener(callback)

    def add_snapshot_listener(self, callback: Callable[[Snapshot], None]) -> None:
        """Called on the training thread after every new snapshot (split inference reloads its weights)."""
        self._snapshot_listeners.append(callback)
        if self.publisher is not None:
            self.publisher.add_snapshot_listener(callback)

    # ---- interface for other threads -----------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.snapshot().step

    @property
    def maddrs(self) -> list[str]:
        return list(self.swarm.maddrs) if self.swarm else []

    @property
    def peer_id(self) -> str:
        return self.swarm.peer_id if self.swarm else ""

    def snapshot(self) -> Snapshot:
        snap = self.publisher.snapshot if self.publisher is not None else None
        if snap is None:
            raise NodeStopped("node has not started")
        return snap

    def submit(self, contribution: Contribution) -> int:
        """Accept one validated contribution for its step; returns the server step.

        Raises StepMismatch (nothing applied) when its step is outside [step - 5, step].
        """
        return self.pool.add(contribution)

    def losses(self) -> list[float]:
        return self.publisher.losses() if self.publisher is not None else list(self._losses)

    def status(self) -> NodeStatus:
        snap = self.snapshot()
        pool, grad = self.pool.counters(), self.gradient.counters()
        nodes = dict(self.presence.nodes) if self.presence else {}
        training = self.swarm.optimizer.tracker.global_progress.num_peers if self.swarm else 1
        return NodeStatus(
            step=snap.step, updates=snap.updates, params_sha256=snap.digest, peer_id=self.peer_id,
            maddrs=tuple(self.maddrs), peers=max(training, len(nodes), 1), training_peers=max(training, 1),
            nodes=tuple(nodes[p] for p in sorted(nodes)), contributors=pool.contributors,
            pending_contributors=pool.pending_contributors, accepted_packets=pool.accepted_packets,
            accepted_samples=pool.accepted_samples, applied_packets=grad.applied_packets,
            applied_samples=grad.applied_samples, carried_packets=grad.carried_packets,
            carried_samples=grad.carried_samples, pending_samples=grad.pending_samples,
            last_update_s=self.publisher.last_update_s if self.publisher is not None else 0.0,
            reachability=self.swarm.reachability.as_dict() if self.swarm else {},
            skipped_rounds=self.swarm.optimizer.skipped_rounds if self.swarm else 0,
            references=self.reference.computed if self.reference else 0,
            reference_seconds=self.reference.seconds if self.reference else 0.0,
            closed=self.swarm.closed if self.swarm else False,
            sync=self.config.swarm.sync,
            wire_codec=self.config.swarm.wire_codec if self.low_comm else None,
            scored_out=self.ledger.summary().scored_out,
            device=self.device.as_dict(),
            first_state=self._first_state,
            round_samples=self.ahead.samples_total if self.ahead is not None else 0,
            torch_threads=threads_now(),
        )

    # ---- joining -------------------------------------------------------------------------------------------

    def _join(self) -> None:
        cfg = self.config
        restored = ckpt.load(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        seed_digest = params_digest(self.model)  # epoch 0's only state, checkpoint or not
        local_opt = make_local_optimizer(self.model, self.train_config)
        inner = None
        if self.low_comm:  # hivemind wraps the outer step; the inner AdamW is this node's own
            inner, local_opt = local_opt, OuterNesterov(self.model.parameters(), lr=cfg.swarm.outer_lr,
                                                        momentum=cfg.swarm.outer_momentum)
            if self.resident:
                inner = None  # made on the device once hivemind forked its processes, below
            else:
                keep_state_shared(inner)  # hivemind forks its processes after this (node.memory)
        if restored is not None and restored.model_config is not None and \
                restored.model_config.architecture() != self.model_config.architecture():
            raise ConfigError(f"the checkpoint in {cfg.checkpoint_dir} holds a model of shape "
                              f"{restored.model_config.architecture()}, this node's is "
                              f"{self.model_config.architecture()}")
        if restored is not None:
            ckpt.check_fits(restored, cfg.checkpoint_dir, self.model, cfg.swarm.sync,
                            feedback=self.low_comm and cfg.swarm.wire_codec == "sparse")
            # restore before hivemind wraps the optimizer: its averagers keep references to these tensors
            load_params(self.model, restored.params)
            saved = restored.optimizer_state
            if len(saved["param_groups"]) != len(local_opt.param_groups):
                saved = regroup_state_dict(saved, local_opt)
            local_opt.load_state_dict(saved)
            self._losses = list(restored.losses)
            logger.info(f"Restored checkpoint: epoch {restored.epoch}, {len(restored.losses)} losses")

        local_gradients = (lambda: self.rounds.offer()) if self.low_comm else self.gradient.mean
        SwarmStateAverager.serve_mbit = cfg.swarm.serve_state_mbit  # read by the averager hivemind makes below
        self.swarm = swarm = Swarm(
            self.swarm_config, local_opt, local_gradients=local_gradients,
            averaging=lowcomm_codec.averaging(self.swarm_config) if self.low_comm else Averaging(),
            round_clock=self.round_clock, others=self.others,
            # low-comm: the loop's rule; whatever downloads sets the inner updates' parameters aside first
            round_due=(lambda: self.loop.round_due) if self.low_comm else None,
            before_state_load=(lambda: self.rounds is not None and self.rounds.enter_outer()) if self.low_comm else None)
        opt = swarm.optimizer
        if restored is not None:
            opt.state_averager.local_epoch = restored.epoch
            opt.tracker.report_local_progress(restored.epoch, 0)
        self.presence = self.others.presence = Presence(
            swarm.dht, swarm.run_id, swarm.owner, swarm.maddrs, cfg.port, model=self.model_config.architecture(),
            epoch=lambda: swarm.epoch)
        self.contact = self.others.contact = Contact(swarm.dht, swarm.peer_id, self.others.announced).start()
        self.agreement = Agreement(swarm.dht, opt, self.model, self.swarm_config, self._stop, seed_digest,
                                   swarm.owner, present=lambda: self.presence.alive(swarm.service))
        if self.dataset is not None:  # each node draws its own batches: a generator seeded by its peer id
            rng = np.random.default_rng(int.from_bytes(swarm.peer_id.encode()[-8:], "little"))
            self.batches = OwnBatches(self.compute, self.dataset, cfg.local_batch_size,
                                      min(cfg.local_seq_len, self.model_config.max_seq_len), rng)
        if self.low_comm and cfg.swarm.wire_codec == "sparse":
            # every node computes the same outer step: a node behind may replay rounds (a joiner's download too)
            self.catchup = CatchUp(swarm, self.agreement, self.model, cfg.swarm.topk_fraction, cfg.swarm.link_mbit)

        checked = restored is not None  # bytes this node may vouch for: a checkpoint, or a checked download
        founder = not cfg.swarm.initial_peers
        self._first_state = "founder" if founder else "checkpoint"
        if not founder:
            self.follower.check_swarm_model()
            swarm.wait_for_progress(timeout_s=10.0)
            behind = self.agreement.saw(opt.tracker.global_epoch) > opt.local_epoch
            if restored is None and not behind and self.agreement.holds_swarm_start(seed_digest, START_RECORD_WAIT_S):
                # every node builds the same seeded (or --init-from) model: at epoch 0 a download would bring the
                # bytes it holds. A swarm that moved on meanwhile is caught up with like any node behind (catch_up)
                self._first_state = "own state"
                logger.info(f"This node's state is the swarm's start (epoch 0, sha256 {seed_digest}): no download")
            elif restored is None or behind or not self.follower.serves_my_bytes():
                checked = self.follower.join_download(self.swarm_config.load_state_timeout_s) is Download.CHECKED
                self._first_state = "download"
        if self.low_comm:
            fraction = cfg.swarm.topk_fraction if cfg.swarm.wire_codec == "sparse" else None
            trained = None
            if self.resident:  # the inner loop on the device: its own copy of the model, its AdamW, its gradient
                replica = self.compute.resident()
                trained, inner = list(replica.parameters()), make_local_optimizer(replica, self.train_config)
                self.gradient.move_to(self.compute.grads_device)
                logger.info(f"The inner loop trains on {self.device.describe()}; the parameters on the CPU take its "
                            f"values once per outer round")
            if self.dataset is not None and cfg.swarm.train_in_rounds:  # trained while a round is on the wire
                # a copy's inner updates, a local batch each as between rounds; else one update's batches, summed
                step = (lambda grads: self.rounds.step_in_round(grads)) if self.resident else None
                allowance = cfg.local_batch_size if self.resident else max(cfg.local_samples_per_update,
                                                                           cfg.local_batch_size)
                self.ahead = Ahead(self.batches.next, allowance, step=step, max_steps=cfg.swarm.inner_steps)
            self.rounds = InnerRounds(list(self.model.parameters()), inner, cfg.swarm.inner_steps, fraction,
                                      published=self._served_f32, min_round_s=self._min_round_s(), trained=trained,
                                      before_write=self.ahead.stop if self.ahead is not None else lambda: None)
            if fraction is not None and cfg.swarm.state_donors > 0 and not swarm.client_mode:
                # nobody can dial a client-mode peer
                outer = opt.state_averager.optimizer
                self.donor = RangeDonor(StateLayout(p.numel() for p in self.model.parameters()), swarm.service,
                                        cfg.swarm.serve_state_mbit, version=lambda: outer.version)
        self.publisher = StepPublisher(self.model, swarm, self.agreement, self.gradient, self.pool, self.low_comm,
                                       donor=self.donor, losses=self._losses)
        for callback in self._snapshot_listeners:
            self.publisher.add_snapshot_listener(callback)
        for callback in self._update_listeners:
            self.publisher.add_update_listener(callback)
        snap = make_snapshot(self.model, opt.local_epoch)
        if (checked and snap.updates > 0) or (snap.updates == 0 and self._first_state in ("founder", "own state")):
            # a founder's epoch 0 is the swarm's start, which a joiner cannot rebuild when it was imported; a joiner
            # that holds it checked it against the founder's record (and is a donor of it: --state-donors)
            self.agreement.vouch(snap)
        self.publisher.publish(snap)
        if self.rounds is not None and restored is not None and restored.round is not None:
            self.loop.resume(restored)  # off the anchor: the snapshot served is the anchor's
            self.publisher.share_state()
        self._last_checkpoint_epoch = opt.local_epoch
        if self._first_state == "download":
            self.follower.after_join_download()  # its replay, then it arrives late and trains at once
        if any(peer != swarm.peer_id for peer in self.presence.refresh(self.step, 0)) and \
                self._first_state != "download":  # a joiner that downloaded was announced all along
            # ready once every node has read its announcement: till then a node that takes a packet updates alone
            self._stop.wait(ANNOUNCE_EVERY_S + 0.5)
        logger.info(f"Node ready at step {self.step} (epoch {opt.local_epoch})")

    # ---- the training thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    worked = self.loop.iteration()
                except Exception as e:  # log and go on: one failed round must not stop the node
                    logger.exception(f"Training round failed: {e!r}")
                    worked = False
                if not worked:
                    self._wake.wait(POLL_S)
                    self._wake.clear()
        except BaseException as e:
            logger.exception(f"Training thread failed: {e}")
        finally:
            self._save_checkpoint()
            self.contact.stop()
            self.swarm.shutdown()
            logger.info("Swarm connection closed")

    # ---- what the loops run on (training thread only) ------------------------------------------------------

    def alone(self) -> bool:
        """No other node in the swarm (presence, the swarm's progress), and no joiner asking for ranges (follow.py)."""
        self.presence.keep_fresh(self.step, self.gradient.samples)  # a node that joined since must not be missed
        if self.donor is not None and self.donor.serving():
            return False
        return self.presence.alone() and self.swarm.optimizer.tracker.global_progress.num_peers <= 1

    def trains_on_own_data(self) -> bool:
        """The node trains on batches of its own data (--train-data, once --wait-for-peers is met)."""
        return self.dataset is not None and self._peers_arrived

    def housekeeping(self) -> None:
        """After each iteration: the presence record kept alive (the agreement's records keep themselves,
        node.swarm.agreement), the heap trimmed and the checkpoint made when due."""
        self.presence.keep_fresh(self.step, self.gradient.samples)
        if time.monotonic() >= self._next_trim:  # the free pages the training passes left in the heap (node.memory)
            self.publisher.background.trim()  # off this thread
            self._next_trim = time.monotonic() + TRIM_EVERY_S
        epoch = self.swarm.epoch
        if self.config.checkpoint_dir and epoch - self._last_checkpoint_epoch >= self.config.checkpoint_every:
            self._save_checkpoint()
            self._last_checkpoint_epoch = epoch

    def wants_local_batch(self) -> bool:
        if self.rounds is not None and self.rounds.due:
            return False
        if not self._peers_arrived and not self._enough_peers():
            return False
        limit = self.config.local_samples_per_update
        # low-comm: per inner update. An outer round waits for --inner-steps of them, which is the wait for the
        # swarm: counted per outer update, a cap under them stopped a node with peers before its round was due
        local = self.gradient.undrained_local_samples if self.low_comm else self.gradient.local_samples
        return limit <= 0 or local < limit

    def _enough_peers(self) -> bool:
        """--wait-for-peers: have that many nodes joined? A node serves step 1 or later once it has; a joiner still
        downloading announces step 0. Once they have, local training goes on whoever leaves."""
        want = self.config.wait_for_peers
        self.presence.keep_fresh(self.step, self.gradient.samples)
        have = sum(1 for info in self.presence.nodes.values() if info.step >= 1)
        if have >= want:
            self._peers_arrived = True
            logger.info(f"{have} nodes in the swarm (--wait-for-peers {want}): training on local data starts")
        elif time.monotonic() >= self._next_wait_log:
            self._next_wait_log = time.monotonic() + 10.0
            logger.info(f"Waiting for {want} nodes before training on local data ({have} so far)")
        return self._peers_arrived

    def local_batch(self) -> None:
        """One batch of the node's own data: its gradient summed over the batch into the pending gradient."""
        self.add_local(self.batches.next())

    def add_local(self, batch: Batch) -> None:
        # the loss as a tensor: on a GPU, reading it now would make the host wait for the pass
        self.gradient.add(batch.sums, batch.samples, 0.0, local=True, adopt=self.compute.owns_grads, loss=batch.loss)

    def _inner_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The AdamW of the node's own updates: low-comm's inner one, or the one hivemind wraps per step."""
        if self.rounds is not None:
            return self.rounds.inner
        return self.swarm.optimizer.state_averager.optimizer if self.swarm is not None else None

    def _served_f32(self) -> Optional[tuple[np.ndarray, ...]]:
        snap = self.publisher.snapshot if self.publisher is not None else None
        return snap.f32 if snap is not None else None

    def _min_round_s(self) -> float:
        """--min-round-seconds, or its default for the device: a GPU's inner updates come many a second."""
        chosen = self.config.swarm.min_round_s
        if chosen is not None:
            return chosen
        return DEFAULT_MIN_ROUND_S_GPU if self.device.is_cuda else 0.0

    def _save_checkpoint(self) -> None:
        if not self.config.checkpoint_dir or self.swarm is None or self.swarm.optimizer is None:
            return
        try:
            params = dict(self.model.named_parameters())
            if self.rounds is not None:  # the swarm's bytes at this epoch; the node's own round goes with them
                params = dict(zip(params, self.rounds.anchor))
            ckpt.save(self.config.checkpoint_dir, ckpt.Checkpoint(
                params=params,
                optimizer_state=self.swarm.optimizer.state_averager.optimizer.state_dict(),
                epoch=self.swarm.epoch,
                losses=self.losses(),
                model_config=self.model_config,
                sync=self.config.swarm.sync,
                round=self.loop.round_state() if self.rounds is not None else None,
            ))
        except Exception as e:
            logger.exception(f"Checkpoint failed: {e}")
