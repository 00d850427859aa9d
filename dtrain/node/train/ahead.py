"""Local batches trained while an outer round is on the wire (low-comm, a node with peers).

An outer round is mostly waiting: for the other nodes to finish their inner updates, for the group, for the peers'
payloads over the link. The training thread sits in hivemind's `Optimizer.step` meanwhile, and the device idles.
`Ahead` runs the node's next local batches on a thread of its own for as long as the round waits, up to one inner
update's allowance (`--local-samples-per-update`, at least one batch), and keeps their summed gradient. The loop
hands it to the pending gradient once the round is over, where it makes the first inner update of the next round:
a gradient of the parameters the round started from, applied one outer step later (the staleness hivemind's
`delay_optimizer_step` and overlapped DiLoCo accept), so no sample computed is dropped.

The passes read the parameters, so nothing may write them while one runs: `stop` ends the work after the pass in
flight and returns once it is done. The round calls it before anything writes the parameters (the outer step, a
download that replaces them: node.lowcomm.rounds, `before_write`), and the loop when `step` returns; the thread never
outlives the `step` call it was started for. The batches are the node's own data, never contributors' packets.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
from hivemind.utils.logging import get_logger

from dtrain.node.train.compute import Batch

logger = get_logger(__name__)


class Ahead:
    def __init__(self, pass_of: Callable[[], Batch], allowance: int):
        """`pass_of`: one local batch's pass (node.train.compute.OwnBatches.next), whose sums are its own tensors.
        `allowance`: the samples of one inner update; a pass starts while fewer are held."""
        if allowance < 1:
            raise ValueError(f"allowance must be >= 1 sample, got {allowance!r}")
        self._pass_of, self.allowance = pass_of, allowance
        self._sums: Optional[list[torch.Tensor]] = None  # what the passes made: their summed gradient
        self.held_samples = 0
        self._loss_sum: Optional[torch.Tensor] = None  # sum(samples * loss) of what is held
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # guards `_thread` against two stops at once
        self.error: Optional[BaseException] = None
        self.samples_total = 0  # samples trained while rounds ran, since start

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> bool:
        """Begin passes on a thread of their own, if the allowance has room; returns whether it did."""
        if self._thread is not None or self.held_samples >= self.allowance:
            return False
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="dtrain-ahead", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """No pass after the one in flight, and return once that one is done. Safe from any thread, and when
        nothing runs (then it returns at once)."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._stopping.set()
            thread.join()
            self._thread = None

    def take(self) -> Optional[Batch]:
        """What the passes made, as one batch (its loss the samples' mean), and nothing held any more. Only once
        stopped."""
        if self._thread is not None:
            raise RuntimeError("take() while the passes run")
        if self._sums is None:
            return None
        batch = Batch(self._sums, self.held_samples, self._loss_sum / self.held_samples)
        self._sums, self.held_samples, self._loss_sum = None, 0, None
        return batch

    def _run(self) -> None:
        try:
            while not self._stopping.is_set() and self.held_samples < self.allowance:
                self._add(self._pass_of())
        except BaseException as e:  # the training thread reports it; a pass that failed adds nothing
            self.error = e
            logger.warning(f"A local batch during the round failed: {e!r}")

    def _add(self, batch: Batch) -> None:
        weighted = batch.loss.detach() * batch.samples
        if self._sums is None:
            self._sums, self._loss_sum = list(batch.sums), weighted
        else:
            with torch.no_grad():
                torch._foreach_add_(self._sums, list(batch.sums))
            self._loss_sum = self._loss_sum + weighted
        self.held_samples += batch.samples
        self.samples_total += batch.samples
