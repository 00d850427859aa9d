"""The node's training thread and the thread-safe interface the bridge calls.

Every call into hivemind happens on one thread owned by `TrainingNode`. Other threads (the HTTP bridge,
split inference) only:
- `submit(...)`: add a samples-weighted gradient contribution for a step (validated by the caller);
- `snapshot()`: read the immutable parameters of the current step (FP32 and FP16, one consistent copy);
- `losses()`, `step`, `status()`.

Gradient bookkeeping. The bridge accumulates `sum(samples_i * g_i)` over packets until
`min_nodes_for_update` distinct contributors have submitted, then hands the sum over. The training thread
adds hand-overs and its own local batches into one epoch accumulator and calls `Optimizer.step` with the new
samples, writing into .grad what makes hivemind's own accumulator exact (see `_step`), so the swarm averages
`sum_i(S_i g_i) / sum_i(S_i)` as NOTES.md asks.

Consistency. After each update the node publishes the digest of its parameters; peers that updated together
compare digests before serving the new step, and one that differs from the reference peer loads its state.
Downloads of the swarm's state are checked against the same records (`node.agreement`).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from hivemind.utils.logging import get_logger

from node import checkpoint as ckpt
from node import swarm
from node.agreement import Agreement
from node.config import ModelConfig, NodeConfig, TrainConfig
from node.data import TokenDataset
from node.model import TensorInfo, build_model, tensor_infos
from node.snapshot import Snapshot, make_snapshot, params_digest

logger = get_logger(__name__)

LATE_WINDOW_STEPS = 5  # packets for [step - 5, step] are accepted (Training API v1, "Late Submissions")
POLL_S = 0.25  # how often an idle training thread looks at the swarm's progress
ANNOUNCE_EVERY_S = 3.0  # how often the node refreshes its record in the swarm's node list
TRAINING_RECENTLY_S = 30.0  # a node that reported samples this recently announces itself as training
SHUTDOWN_TIMEOUT_S = 5.0  # how long hivemind may take to leave the swarm when stopped under an update


class StepMismatch(Exception):
    """A contribution's step is outside the accepted window; the client must fetch the latest model."""

    def __init__(self, server_step: int):
        super().__init__(f"step mismatch; fetch latest model (server step {server_step})")
        self.server_step = server_step


class NodeStopped(RuntimeError):
    pass


@dataclass
class _Contributions:
    """Bridge packets gathered since the last hand-over (guarded by TrainingNode._lock)."""

    sums: list[np.ndarray]  # per tensor: sum(samples * grad), flat float32
    samples: int = 0
    loss_sum: float = 0.0  # sum(samples * train_loss)
    node_ids: set = field(default_factory=set)


@dataclass(frozen=True)
class _HandOver:
    sums: list[np.ndarray]
    samples: int
    loss_sum: float


class TrainingNode:
    """One node of the swarm: owns the model, the DHT, hivemind.Optimizer and the training thread."""

    def __init__(self, config: NodeConfig, model_config: ModelConfig, train_config: TrainConfig,
                 dataset: Optional[TokenDataset] = None):
        self.config, self.model_config, self.train_config = config, model_config, train_config
        self.dataset = dataset
        self.model = build_model(model_config)
        self.tensors: tuple[TensorInfo, ...] = tensor_infos(self.model)
        self.total_params = sum(t.elements for t in self.tensors)
        self.maddrs: list[str] = []
        self.peer_id: str = ""

        self._lock = threading.Lock()
        self._contrib = self._empty_contributions()
        self._queue: "queue.Queue[_HandOver]" = queue.Queue()
        self._losses: list[float] = []
        self._snapshot: Optional[Snapshot] = None
        self._contributors_seen: set = set()
        self._samples_total = 0
        self._num_peers = 1
        self._swarm_nodes: dict[str, dict] = {}
        self._last_announce = 0.0
        self._last_samples_at = -TRAINING_RECENTLY_S  # when this node last reported samples to the swarm
        self._snapshot_listeners: list[Callable[[Snapshot], None]] = []
        self._agreement: Optional[Agreement] = None

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dtrain-training", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Join (or start) the swarm and catch up, then start the training thread; returns once it may serve.

        Call it from the main thread: hivemind's averagers install signal handlers when they are created.
        """
        self.dht = self.optimizer = None
        try:
            self._join()
        except BaseException:
            swarm.shutdown(self.optimizer, self.dht)
            raise
        self._thread.start()

    def stop(self, grace_s: float = 3.0) -> None:
        """Stop training; the thread saves a checkpoint and leaves the swarm.

        An all-reduce in flight can take up to averaging_timeout; past `grace_s` the swarm connection is shut
        down under it (the checkpoint from the last completed interval stands) so the process exits promptly.
        """
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(grace_s)
        if self._thread.is_alive():
            logger.warning("An update is still in flight; leaving the swarm without waiting for it")
            swarm.shutdown(self.optimizer, self.dht, timeout_s=SHUTDOWN_TIMEOUT_S)
            self._thread.join(2.0)

    def add_snapshot_listener(self, callback: Callable[[Snapshot], None]) -> None:
        """Called on the training thread after every new snapshot (split inference reloads its weights)."""
        self._snapshot_listeners.append(callback)

    # ---- interface for other threads -----------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.snapshot().step

    def snapshot(self) -> Snapshot:
        snap = self._snapshot
        if snap is None:
            raise NodeStopped("node has not started")
        return snap

    def losses(self) -> list[float]:
        with self._lock:
            return list(self._losses)

    def status(self) -> dict:
        snap = self.snapshot()
        with self._lock:
            return {
                "step": snap.step,
                "updates": snap.updates,
                "peers": max(self._num_peers, len(self._swarm_nodes)),
                "training_peers": self._num_peers,
                "nodes": [dict(info, peer_id=pid) for pid, info in sorted(self._swarm_nodes.items())],
                "peer_id": self.peer_id,
                "maddrs": list(self.maddrs),
                "contributors": len(self._contributors_seen),
                "samples_total": self._samples_total,
                "pending_contributors": len(self._contrib.node_ids),
                "params_sha256": snap.digest,
            }

    def check_step(self, packet_step: int) -> int:
        step = self.step
        if not step - LATE_WINDOW_STEPS <= packet_step <= step:
            raise StepMismatch(step)
        return step

    def submit(self, node_id: str, packet_step: int, samples: int, train_loss: float,
               scatter: Callable[[Sequence[np.ndarray], float], None]) -> int:
        """Add one validated contribution; `scatter(sums, weight)` adds weight * its gradient into `sums`.

        Raises StepMismatch (nothing applied) when packet_step is outside [step - 5, step].
        Returns the server step.
        """
        with self._lock:
            step = self.check_step(packet_step)
            contrib = self._contrib
            scatter(contrib.sums, float(samples))
            contrib.samples += samples
            contrib.loss_sum += float(samples) * float(train_loss)
            contrib.node_ids.add(node_id)
            self._contributors_seen.add(node_id)
            self._samples_total += samples
            if len(contrib.node_ids) >= self.train_config.min_nodes_for_update:
                self._queue.put(_HandOver(contrib.sums, contrib.samples, contrib.loss_sum))
                self._contrib = self._empty_contributions()
            return step

    # ---- the training thread -------------------------------------------------------------------------------

    def _empty_contributions(self) -> _Contributions:
        return _Contributions(sums=[np.zeros(t.elements, dtype=np.float32) for t in self.tensors])

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            logger.exception(f"Training thread failed: {e}")
        finally:
            self._save_checkpoint()
            swarm.shutdown(self.optimizer, self.dht)
            logger.info("Swarm connection closed")

    def _join(self) -> None:
        cfg = self.config
        restored = ckpt.load(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        seed_digest = params_digest(self.model)  # epoch 0's only state, checkpoint or not
        local_opt = swarm.make_local_optimizer(self.model, self.train_config)
        if restored is not None:
            # restore before hivemind wraps the optimizer: its averagers keep references to these tensors
            self.model.load_state_dict(restored.model_state)
            local_opt.load_state_dict(restored.optimizer_state)
            self._losses = list(restored.losses)
            logger.info(f"Restored checkpoint: epoch {restored.epoch}, {len(restored.losses)} losses")

        self.dht = swarm.create_dht(cfg.swarm)
        self.maddrs = swarm.visible_maddrs(self.dht)
        self.peer_id = str(self.dht.peer_id)
        self.optimizer = swarm.make_swarm_optimizer(self.dht, local_opt, cfg.swarm)
        self.optimizer.local_gradients = self._local_mean_gradients
        self.optimizer.update_priority = swarm.update_priority(self.peer_id)
        if restored is not None:
            self.optimizer.state_averager.local_epoch = restored.epoch
            self.optimizer.tracker.report_local_progress(restored.epoch, 0)

        self._agreement = Agreement(self.dht, self.optimizer, self.model, cfg.swarm, self._stop, seed_digest)
        known_state = restored is not None  # bytes this node may vouch for: a checkpoint, or a checked download
        if cfg.swarm.initial_peers:
            swarm.wait_for_swarm_progress(self.optimizer, timeout_s=10.0)
            if self.optimizer.tracker.global_epoch > self.optimizer.local_epoch or restored is None:
                known_state = self._agreement.load_state_from_peers()
        self._epoch = self.optimizer.local_epoch
        self._reset_epoch_accumulator()
        snap = make_snapshot(self.model, self._epoch)
        if known_state and snap.updates > 0:
            self._agreement.vouch(snap)
        self._publish(snap)
        self._announce()  # and learn who is in the swarm: the first update may come with this node's first batch
        # until its first update a joiner cannot know who trains: it compares with every node it sees
        self._epoch_peers = max(1, len(self._swarm_nodes))
        logger.info(f"Node ready at step {self._snapshot.step} (epoch {self._epoch})")

    def _reset_epoch_accumulator(self) -> None:
        self._epoch_sums = [torch.zeros(t.elements) for t in self.tensors]
        self._epoch_samples = 0
        self._epoch_local_samples = 0  # samples of this node's own data this epoch
        self._epoch_peers = 1  # the most training peers the swarm's progress showed this epoch
        self._epoch_loss_sum = 0.0

    def _local_mean_gradients(self) -> list[torch.Tensor]:
        """This epoch's samples-weighted mean gradient of everything this node gathered (hivemind's fallback)."""
        return [acc / max(self._epoch_samples, 1) for acc in self._epoch_sums]

    def _publish(self, snap: Snapshot) -> None:
        self._snapshot = snap
        norm = float(np.sqrt(sum(np.dot(a.astype(np.float64), a) for a in snap.f32)))
        logger.info(f"step {snap.step} params sha256 {snap.digest} l2 {norm:.12e}")
        for callback in self._snapshot_listeners:
            try:
                callback(snap)
            except Exception as e:
                logger.exception(f"snapshot listener failed: {e}")

    def _loop(self) -> None:
        rng = np.random.default_rng(int.from_bytes(self.peer_id.encode()[-8:], "little"))
        self._last_checkpoint_epoch = self.optimizer.local_epoch
        while not self._stop.is_set():
            try:
                worked = self._iteration(rng)
            except Exception as e:  # log and go on: one failed round must not stop the node
                logger.exception(f"Training round failed: {e!r}")
                worked = False
            if not worked:
                self._stop.wait(POLL_S)

    def _iteration(self, rng: np.random.Generator) -> bool:
        worked = False
        while (hand_over := self._next_hand_over()) is not None:
            self._accumulate(hand_over.sums, hand_over.samples, hand_over.loss_sum)
            self._step()
            worked = True
        if self.dataset is not None and self._wants_local_batch():
            self._local_batch(rng)
            worked = True
        if not worked:
            self._idle()
        self._num_peers = max(1, self.optimizer.tracker.global_progress.num_peers)
        self._epoch_peers = max(self._epoch_peers, self._num_peers)
        if time.monotonic() - self._last_announce >= ANNOUNCE_EVERY_S:
            self._announce()
        epoch = self.optimizer.local_epoch
        if self.config.checkpoint_dir and epoch - self._last_checkpoint_epoch >= self.config.checkpoint_every:
            self._save_checkpoint()
            self._last_checkpoint_epoch = epoch
        return worked

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _wants_local_batch(self) -> bool:
        limit = self.config.local_samples_per_update
        return limit <= 0 or self._epoch_local_samples < limit

    def _next_hand_over(self) -> Optional[_HandOver]:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def _accumulate(self, sums, samples: int, loss_sum: float) -> None:
        for acc, part in zip(self._epoch_sums, sums):
            acc.add_(torch.as_tensor(part).reshape(-1))
        self._epoch_samples += samples
        self._epoch_loss_sum += loss_sum

    def _local_batch(self, rng: np.random.Generator) -> None:
        cfg = self.config
        seq_len = min(cfg.local_seq_len, self.model_config.max_seq_len)
        tokens = torch.from_numpy(self.dataset.batch(cfg.local_batch_size, seq_len, rng).astype(np.int64))
        loss = self.model(input_ids=tokens, labels=tokens).loss
        # autograd.grad, not backward(): the .grad buffers belong to hivemind (reuse_grad_buffers)
        grads = torch.autograd.grad(loss, list(self.model.parameters()))
        batch = tokens.shape[0]
        self._epoch_local_samples += batch
        self._accumulate([g.detach() * batch for g in grads], batch, batch * loss.item())
        self._step()

    def _step(self) -> None:
        """One hivemind Optimizer.step reporting the samples gathered since the last call (none when idle).

        hivemind divides its .grad buffers by the number of step() calls of the epoch when it averages, and
        weighs this peer by the samples it reported. Writing sum(S_i g_i) * calls / samples into the buffers
        before each call makes the gradient it averages exactly the samples-weighted mean. Its own counters are
        the reference: a catch-up from peers resets them without a new epoch.
        """
        opt = self.optimizer
        # a reference peer that published its last update after this node compared; always right before an update
        self._recheck(force=opt.tracker.ready_to_update_epoch)
        counted = opt.grad_averager
        new_samples = max(self._epoch_samples - counted.local_samples_accumulated, 0)
        scale = (counted.local_times_accumulated + 1) / self._epoch_samples
        with torch.no_grad():
            for p, acc in zip(self.model.parameters(), self._epoch_sums):
                p.grad.copy_(acc.view_as(p)).mul_(scale)
        samples, mean_loss = self._epoch_samples, self._epoch_loss_sum / self._epoch_samples
        epoch_before = opt.local_epoch
        if new_samples:
            self._last_samples_at = time.monotonic()
        opt.step(batch_size=new_samples)
        # a new epoch is an update of this peer's, or a state hivemind downloaded inside step() ("out of sync")
        updated = opt.local_epoch != epoch_before and opt.last_update_epoch == opt.local_epoch
        if updated:
            with self._lock:
                self._losses.append(mean_loss)
                announced = sum(1 for info in self._swarm_nodes.values() if info.get("training"))
            logger.info(f"update {opt.local_epoch}: {samples} samples, loss {mean_loss:.4f}")
            # the peers to compare with: those averaging this update, or any seen training this epoch or announced
            # as training (a peer that updates alone, e.g. right after it joined, still has to agree with the others)
            self._after_step(update_of=max(opt.peers_in_last_update, self._epoch_peers, announced))
        elif opt.local_epoch != epoch_before:
            self._after_step(caught_up=self._agreement.check_download())

    def _idle(self) -> None:
        opt = self.optimizer
        if self._epoch_samples > 0:
            self._step()  # lets hivemind schedule and run the update the swarm is gathering samples for
        elif opt.tracker.global_epoch > opt.local_epoch:
            # the swarm moved on without us: take its state
            logger.info(f"Behind the swarm (epoch {opt.local_epoch} < {opt.tracker.global_epoch}); loading state")
            self._after_step(caught_up=self._agreement.load_state_from_peers())

    def _after_step(self, update_of: int = 0, caught_up: bool = False) -> None:
        """Publish the parameters of a new epoch; after an update of `update_of` peers, agree with them."""
        if self.optimizer.local_epoch == self._epoch:
            return
        snap = make_snapshot(self.model, self.optimizer.local_epoch)
        if update_of > 0:
            snap = self._agreement.after_update(snap, update_of)
        elif caught_up:
            self._agreement.vouch(snap)
        else:
            self._agreement.forget()
        self._epoch = self.optimizer.local_epoch
        self._reset_epoch_accumulator()
        self._publish(snap)

    def _recheck(self, force: bool) -> None:
        """Serve the reference peer's parameters of this node's last update if it published after we compared."""
        snap = self._snapshot
        agreed = self._agreement.recheck(snap, force)
        if agreed is not snap:
            if agreed.updates != self._epoch:
                self._epoch = agreed.updates
                self._reset_epoch_accumulator()
            self._publish(agreed)

    def _announce(self) -> None:
        self._last_announce = time.monotonic()
        run_id = self.config.swarm.run_id
        training = time.monotonic() - self._last_samples_at < TRAINING_RECENTLY_S
        info = {"step": self.step, "bridge_port": self.config.port, "maddrs": self.maddrs[:4], "training": training}
        swarm.announce(self.dht, run_id, self.peer_id, info)
        self._agreement.keep_alive()
        nodes = swarm.list_nodes(self.dht, run_id)
        with self._lock:
            self._swarm_nodes = nodes

    def _save_checkpoint(self) -> None:
        if not self.config.checkpoint_dir or self.optimizer is None:
            return
        try:
            ckpt.save(self.config.checkpoint_dir, ckpt.Checkpoint(
                model_state={k: v.clone() for k, v in self.model.state_dict().items()},
                optimizer_state=self.optimizer.state_averager.optimizer.state_dict(),
                epoch=self.optimizer.local_epoch,
                losses=self.losses(),
            ))
        except Exception as e:
            logger.exception(f"Checkpoint failed: {e}")
