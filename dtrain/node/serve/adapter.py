"""Feedback that trains a named LoRA adapter instead of the shared model (`--feedback-lora NAME`).

The adapter is a LoRA expert (node.split.experts.LoraExpert: `B (A h) * scale` added to the final hidden state),
served as `model=NAME` on the node's /v1 API. Every `--feedback-interval` seconds the trainer takes up to
`--feedback-batch` rewarded rows no training used yet and computes, on the node's current shared model (frozen),
the gradient of the same reward-weighted loss as node/serve/feedback.py, with the adapter in the path, with respect
to A and B only. The gradient goes into the adapter's own hivemind.Optimizer (AdamW), run id
`<run_id>_lora_<NAME>`, on the node's DHT: the nodes that train the same NAME accumulate together until they
gathered `--feedback-lora-target` samples (or their samples stopped growing for the swarm's settle time), then
all-reduce their gradients, step, and average their parameters and Adam moments, so they hold the same bytes.
After each update the new A and B are copied into a fresh expert that replaces the served one by name (a
hot swap: requests admitted from then on use it; nothing restarts). The shared model, its training loop and its
run id are untouched.

Every node starts from the same adapter: A is drawn with a seed derived from NAME, B is zero (the adapter starts
as the bare shared model). A node behind the adapter's swarm (it joined late, or missed a round) downloads the
adapter's state from a peer before training on.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import hivemind
import numpy as np
import torch
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils.logging import get_logger

from dtrain.node.frozen import on_snapshot
from dtrain.node.serve.capture import CaptureStore, Record
from dtrain.node.serve.config import ServeConfig, check_adapter_name
from dtrain.node.serve.feedback import mean_gradient, record_loss, run_rounds
from dtrain.node.split.experts import ExpertRegistry, LoraExpert
from dtrain.node.swarm.others import AlwaysPresent
from dtrain.node.swarm.tracker import PacedTracker

logger = get_logger(__name__)

SHUTDOWN_TIMEOUT_S = 20.0  # bound on stopping the adapter's averagers


def adapter_run_id(run_id: str, name: str) -> str:
    return f"{run_id}_lora_{check_adapter_name(name)}"


def adapter_seed(name: str) -> int:
    """The seed of A's initialisation: the same on every node for the same name."""
    return int.from_bytes(hashlib.sha256(f"dtrain-lora:{name}".encode()).digest()[:4], "big")


def adapter_digest(expert: LoraExpert) -> str:
    """sha256 of A then B as little-endian float32 bytes: equal on two nodes iff they serve the same adapter."""
    h = hashlib.sha256()
    for m in (expert.A, expert.B):
        h.update(np.ascontiguousarray(m, dtype="<f4").tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class AdapterState:
    """What serving has now: the adapter's epoch (its updates) and the digest of its bytes."""

    name: str
    epoch: int
    sha256: str
    samples: int  # rewarded completions this node put into the adapter's gradients so far
    peers: int  # peers whose gradients this node's last update averaged (0: no update yet or downloaded)


def adapter_gradient(model: torch.nn.Module, expert: LoraExpert,
                     records: Sequence[Record]) -> tuple[list[torch.Tensor], float, int]:
    """(dL/d(A, B) averaged over the records with signal, L, N) with `model` frozen; N may be 0."""
    return mean_gradient(expert.parameters(), records, lambda r: record_loss(model, r, expert=expert))


class AdapterOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with the paced tracker of node.swarm, and a way to join a round the other peers began."""

    def __init__(self, *, settle_s: float, **kwargs):
        self._settle_s = settle_s
        self.last_group_size = 0  # peers whose gradients the last update averaged (1: this node's own alone)
        self.updates = 0  # updates this node made (not counting state downloads)
        super().__init__(**kwargs)

    def _update_global_epoch(self, grad_scaler) -> None:
        self.last_group_size = 1  # unless an all-reduce below succeeds
        super()._update_global_epoch(grad_scaler)
        self.updates += 1

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        group = 1
        if maybe_step_control is not None and maybe_step_control.done() and not maybe_step_control.cancelled():
            if maybe_step_control.exception() is None:
                group = len(maybe_step_control.result())
        self.last_group_size = group

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        # the shared model's rule without its ETA (feedback arrives in bursts; an ETA from one burst made a node
        # update alone). At the target it also waits for another peer's progress: a peer that just stepped counts
        # its own samples before it read the others' records again, and with the target alone it began an update
        # that saw one peer and skipped the all-reduce. A lone node updates by the settle rule.
        tracker = PacedTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                               client_mode=self.client_mode, status_loglevel=self.status_loglevel, start=True,
                               settle_s=self._settle_s, others=AlwaysPresent(), **kwargs)
        return tracker

    def join_round(self) -> bool:
        """Take part in the update the swarm is ready for with the gradients accumulated so far; False if none.

        `step(batch_size=0)` would do it too, but hivemind divides the accumulators by the number of step() calls,
        so each empty call would shrink this node's gradient."""
        if self.grad_averager.local_samples_accumulated == 0 or not self.tracker.ready_to_update_epoch:
            return False
        self._maybe_schedule_gradient_averaging()
        self._maybe_schedule_state_averaging()
        self._update_global_epoch(None)
        return True


class AdapterTrainer:
    """Trains the adapter `name` on rewarded rows of `store`, averaged over the nodes that train it too, and swaps
    each new version into `registry` (the serving engine's experts). Built on the main thread (hivemind's
    averagers are processes that install signal handlers); trains on its own thread."""

    def __init__(self, node, store: CaptureStore, template: torch.nn.Module, registry: ExpertRegistry,
                 config: ServeConfig):
        name = check_adapter_name(config.feedback_lora)
        if name in registry:
            raise ValueError(f"--feedback-lora {name!r}: an expert of that name is hosted already (--expert)")
        self.name = name
        self._node = node
        self._store = store
        self._template = template  # shapes and tied-parameter layout; never trained itself
        self._registry = registry
        self._batch = config.feedback_batch
        self._interval_s = config.feedback_interval_s
        d_model = int(template.config.n_embd)
        rank = min(config.feedback_lora_rank, d_model)
        self.expert = LoraExpert.create(name, d_model, r=rank, alpha=2.0 * rank, seed=adapter_seed(name))
        self._lock = threading.Lock()
        self._samples = 0
        self._state: Optional[AdapterState] = None
        swarm = node.config.swarm
        self.optimizer = AdapterOptimizer(
            settle_s=swarm.settle_s,
            dht=node.swarm.dht,
            run_id=adapter_run_id(node.swarm.run_id, name),  # the run's DHT name: keyed in a closed swarm
            target_batch_size=config.feedback_lora_target,
            params=self.expert.parameters(),  # A then B, the same order on every node
            optimizer=partial(torch.optim.AdamW, lr=config.feedback_lora_lr, weight_decay=0.0),
            matchmaking_time=swarm.matchmaking_time_s,
            averaging_timeout=swarm.averaging_timeout_s,
            load_state_timeout=swarm.load_state_timeout_s,
            delay_state_averaging=False,
            average_state_every=1,  # parameters and moments averaged after every update: the peers hold one adapter
            average_opt_statistics=("exp_avg", "exp_avg_sq"),
            averager_opts=dict(request_timeout=swarm.request_timeout_s),
            tracker_opts=dict(min_refresh_period=0.2, max_refresh_period=1.0, default_refresh_period=0.5,
                              private_key=node.swarm.owner.private_key),  # the DHT's record key
        )
        self._publish()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dtrain-feedback-lora", daemon=True)

    # ---- lifecycle

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop training, then the adapter's averagers (bounded: hivemind's own shutdown may wait on a round)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        done = threading.Event()

        def shut():
            try:
                self.optimizer.shutdown()
            except Exception as e:
                logger.warning(f"adapter {self.name!r}: shutting its optimizer down failed: {e!r}")
            done.set()
        threading.Thread(target=shut, name="dtrain-lora-shutdown", daemon=True).start()
        if not done.wait(timeout_s):
            for averager in (self.optimizer.grad_averager, self.optimizer.state_averager):
                if averager is not None and averager.is_alive():
                    logger.warning(f"adapter {self.name!r}: {type(averager).__name__} did not stop; terminating it")
                    averager.terminate()

    def state(self) -> AdapterState:
        with self._lock:
            return self._state

    # ---- training

    def _run(self) -> None:
        run_rounds(self.run_once, self._stop, self._interval_s, f"adapter {self.name!r}: feedback")

    def run_once(self) -> Optional[int]:
        """One round: catch up, accumulate the unused rewarded rows, join an update that is ready.
        Returns the number of rows that went into the adapter's gradients (None when there were none)."""
        opt = self.optimizer
        if opt.tracker.global_epoch > opt.local_epoch:  # the adapter's swarm updated without this node
            logger.info(f"adapter {self.name!r}: epoch {opt.local_epoch} behind {opt.tracker.global_epoch}; "
                        "downloading its state")
            opt.load_state_from_peers()
            self._publish()
        used = None
        rows = self._store.untrained_rewarded(self._batch)
        if rows:
            used = self._accumulate(rows)
        else:
            opt.join_round()  # an update the other nodes began, with what this node accumulated before
        if opt.local_epoch != self.state().epoch:
            self._publish(peers=opt.last_group_size)
        return used

    def _accumulate(self, rows) -> int:
        opt = self.optimizer
        model = self._base_model()
        grads, loss, used = adapter_gradient(model, self.expert, [r for _, r in rows])
        keys, epoch = [(seq,) for seq, _ in rows], opt.local_epoch
        if used == 0:
            self._store.mark_trained(keys, epoch)
            return 0
        with torch.no_grad():
            for p, g in zip(self.expert.parameters(), grads):
                p.grad = g.clone()
        held, updates = opt.grad_averager.local_samples_accumulated, opt.updates
        opt.step(batch_size=used)  # accumulates; updates (all-reduce, AdamW, averaging) once ready
        if opt.updates == updates and opt.grad_averager.local_samples_accumulated <= held:
            # hivemind found this node out of sync, downloaded the state and dropped the gradient: the rows wait
            logger.info(f"adapter {self.name!r}: out of sync at epoch {epoch}; {used} rows wait for the next round")
            return 0
        self._store.mark_trained(keys, epoch)  # the adapter epoch the rows went into
        with self._lock:
            self._samples += used
        logger.info(f"adapter {self.name!r}: {used} rewarded completions, loss {loss:.4f}, epoch {epoch}")
        return used

    def _base_model(self) -> torch.nn.Module:
        """The node's current shared model, frozen: its parameters are the current snapshot's bytes (node.frozen),
        held only for this round, so no older snapshot outlives the node's next update here."""
        return on_snapshot(self._template, self._node.snapshot().f32)

    def _publish(self, peers: int = 0) -> None:
        """Swap a copy of the adapter as it is now into serving (the trained tensors stay this thread's)."""
        served = LoraExpert.from_matrices(self.name, self.expert.A, self.expert.B, self.expert.scale)
        self._registry.add(served)
        with self._lock:
            self._state = AdapterState(self.name, self.optimizer.local_epoch, adapter_digest(served), self._samples,
                                       peers)
        logger.info(f"adapter {self.name!r} epoch {self._state.epoch} sha256 {self._state.sha256} "
                    f"(gradients of {peers} peer(s))")
