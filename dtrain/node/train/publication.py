"""The publication of a served step: what browsers download, `/v1` and split inference answer from, and peers agree
on (docs/spec/NOTES.md, "At the speed of the hardware").

A served step costs its bookkeeping once: the parameters' digest, the agreement with the update's peers (DHT
records, node.swarm.agreement), the snapshot (node.snapshot: one copy, made once the peers agree on the digest, so
that what the update's round held is gone first), what a downloading peer gets (node.swarm.state.ServedState, and a
range donor's copy), the log line and the listeners. Inner updates between served steps are the node's own: they are
not hashed, copied or recorded. An update is published in three calls, so that the low-comm loop can let its round's
buffers go between them: `agree`, `snapshot_of`, `served`. Training thread only; other threads read `snapshot`.
What nothing waits for (the parameters' L2 norm for the log, handing the heap's free pages back) runs on a thread of
its own (`Background`): on a GPU node the inner loop goes on meanwhile.
"""
from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
from hivemind.utils.logging import get_logger

from dtrain.node import memory
from dtrain.node.lowcomm.statefetch import RangeDonor
from dtrain.node.snapshot import PendingSnapshot, Snapshot
from dtrain.node.swarm.agreement import Agreement, Verdict
from dtrain.node.swarm.optimizer import RoundOutcome
from dtrain.node.swarm.swarm import Swarm
from dtrain.node.swarm.state import ServedState
from dtrain.node.train.gradient import PendingGradient
from dtrain.node.train.pool import ContributionPool

logger = get_logger(__name__)


class StepPublisher:
    def __init__(self, model: torch.nn.Module, swarm: Swarm, agreement: Agreement, gradient: PendingGradient,
                 pool: ContributionPool, low_comm: bool, donor: Optional[RangeDonor] = None,
                 losses: Optional[list[float]] = None):
        self.model, self.swarm, self.agreement = model, swarm, agreement
        self.gradient, self.pool, self.low_comm, self.donor = gradient, pool, low_comm, donor
        self.snapshot: Optional[Snapshot] = None  # the served step; replaced whole, never mutated
        self._lock = threading.Lock()  # guards _losses
        self._losses: list[float] = list(losses or [])
        self._snapshot_listeners: list[Callable[[Snapshot], None]] = []
        self._update_listeners: list[Callable[[float], None]] = []
        self.last_update_s = 0.0  # how long the last update took, all of it (0 before the first)
        self._last_served_at = time.monotonic()
        self.background = Background()

    def add_snapshot_listener(self, callback: Callable[[Snapshot], None]) -> None:
        self._snapshot_listeners.append(callback)

    def add_update_listener(self, callback: Callable[[float], None]) -> None:
        self._update_listeners.append(callback)

    def losses(self) -> list[float]:
        with self._lock:
            return list(self._losses)

    # ---- an update, in three calls ---------------------------------------------------------------------------

    def agree(self, outcome: RoundOutcome) -> Verdict:
        """The update's peers agree on the digest of its parameters; no copy of them is made yet."""
        return self.agreement.after_update(PendingSnapshot.of(self.model, outcome.epoch), outcome)

    def snapshot_of(self, verdict: Verdict) -> Optional[Snapshot]:
        """The snapshot the swarm serves for the update: made here when it is this node's bytes (nothing may write
        the parameters between `agree` and this), or the one the agreement loaded; None when no download agreed."""
        snap = verdict.snapshot
        return snap.make(self.model) if isinstance(snap, PendingSnapshot) else snap

    def served(self, verdict: Verdict, snap: Optional[Snapshot], outcome: RoundOutcome, started: float,
               inner_updates: int = 0) -> bool:
        """The pending gradient settled (or carried), the log line, the step published; False when there is no
        snapshot to serve (the node keeps serving the last step until a download agrees). `started`: when the update
        began (time.monotonic()); the log's duration covers all of it, publication included."""
        if verdict.included:
            applied = self.gradient.settle()
            if applied.samples:  # a full peer that joined only for client-mode peers' samples has no loss of its own
                with self._lock:
                    self._losses.append(applied.mean_loss)
        else:
            self.gradient.carry()
        if snap is not None:
            self.publish(snap)
        self.background.trim()  # what the update freed (round buffers, the snapshot's making) leaves the heap
        now = time.monotonic()
        took_s, since_s = now - started, now - self._last_served_at
        self._last_served_at = now
        if verdict.included:
            totals, accepted = self.gradient.counters(), self.pool.counters().accepted_samples
            loss = f"loss {applied.mean_loss:.4f}" if applied.samples else "none of its own, joined for client-mode peers"
            inner = f", {inner_updates} inner updates" if inner_updates else ""
            logger.info(f"update {outcome.epoch}: {applied.samples} samples, {loss}; {applied.packets} packets, "
                        f"{len(outcome.group)} peers{inner}, took {took_s:.1f}s, {since_s:.1f}s since the last "
                        f"({applied.samples / max(since_s, 1e-9):.1f} samples/s); this node so far: accepted "
                        f"{accepted}, applied {totals.applied_samples}, carried {totals.carried_samples} samples")
        else:
            logger.info(f"update {outcome.epoch} went without this node's gradient (peer {verdict.reference}'s "
                        f"bytes); carrying {self.gradient.samples} samples into the next update")
        self.last_update_s = took_s
        for callback in self._update_listeners:
            try:
                callback(took_s)
            except Exception as e:
                logger.exception(f"update listener failed: {e}")
        return snap is not None

    # ---- serving a step --------------------------------------------------------------------------------------

    def publish(self, snap: Snapshot) -> None:
        """`snap` is the served step from now on: for other threads, for peers that download (low-comm: the
        snapshot's bytes and the outer state of their epoch, never the inner updates' parameters), and for the
        listeners. Its log line comes first: whoever sees the step served (the status, a peer) finds its digest in
        the log."""
        logger.info(f"step {snap.step} params sha256 {snap.digest}")
        self.snapshot = snap
        self.background.log_norm(snap)
        averager = self.swarm.optimizer.state_averager
        if self.donor is not None:  # this epoch's state: the snapshot and, until the next outer step, the momentum
            self.donor.hold(snap.updates, snap.f32, *averager.optimizer.momentum(list(self.model.parameters())))
        if self.low_comm:
            averager.served = ServedState(snap.updates, snap.f32, averager.optimizer.version)
        self.share_state()
        for callback in self._snapshot_listeners:
            try:
                callback(snap)
            except Exception as e:
                logger.exception(f"snapshot listener failed: {e}")

    def share_state(self) -> None:
        """Peers may download this node's state (off while it loads one); nobody can download from a client-mode
        peer."""
        if not self.swarm.client_mode:
            self.swarm.optimizer.state_averager.allow_state_sharing = True


class Background:
    """A served step's work that nothing waits for, on one thread of its own: the log line of the parameters' L2
    norm, and handing the heap's free pages back (node.memory.trim). At most one job of each kind waits: a step served
    while the last norm is still being computed logs none (the norm is for people reading the log; the digest is what
    peers agree on), and one trim covers everything freed before it runs."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrain-publication")
        self._pending: dict[Callable, Future] = {}  # per kind of job, the last one submitted

    def _submit(self, job: Callable, *args) -> None:
        last = self._pending.get(job)
        if last is None or last.done():
            self._pending[job] = self._pool.submit(job, *args)

    def log_norm(self, snap: Snapshot) -> None:
        self._submit(_log_norm, snap)

    def trim(self) -> None:
        self._submit(memory.trim)

    def wait(self, timeout_s: float = 60.0) -> None:
        """Until the jobs submitted so far are done (tests)."""
        self._pool.submit(lambda: None).result(timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _log_norm(snap: Snapshot) -> None:
    try:
        logger.info(f"step {snap.step} params l2 {l2_norm(snap):.12e}")
    except Exception as e:  # the snapshot's memory went with a node that stopped
        logger.warning(f"step {snap.step}: no L2 norm ({e})")


def l2_norm(snap: Snapshot) -> float:
    """The L2 norm of a step's parameters, accumulated in float64 (the log line's, comparable across nodes): torch's
    threaded reduction, where a float64 copy of each tensor in numpy cost a lone node a twentieth of its time."""
    with warnings.catch_warnings():  # the snapshot's arrays are read-only, and only read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        squares = [torch.linalg.vector_norm(torch.from_numpy(a), dtype=torch.float64) ** 2 for a in snap.f32]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0
