"""Local batches trained while an outer round is on the wire (low-comm, a node with peers).

An outer round is mostly waiting: for the other nodes to finish their inner updates, for the group, for the peers'
payloads over the link. The training thread sits in hivemind's `Optimizer.step` meanwhile, and the device idles.
`Ahead` runs the node's next local batches on a thread of its own for as long as the round waits:
- the inner loop trains the parameters themselves (on the CPU): up to one inner update's allowance
  (`--local-samples-per-update`, at least one batch), whose summed gradient it keeps. The loop hands it to the
  pending gradient once the round is over, where it makes the first inner update of the next round: a gradient of
  the parameters the round started from, applied one outer step later (the staleness hivemind's
  `delay_optimizer_step` and overlapped DiLoCo accept), so no sample computed is dropped;
- the inner loop is resident (node.train.compute, on a GPU): the round reads the parameters, not the device's copy,
  so the inner updates go on, each of a local batch as between rounds, applied to the copy at once (`step`:
  node.lowcomm.rounds, `step_in_round`), up to `max_steps` of them: as many as were made before the round,
  --inner-steps at least (a GPU's round is due by time, --min-round-seconds, and holds more). The round's end puts
  the outer step's result under them; they are the next round's first inner updates, and their samples and loss
  its own (`take_trained`). A batch's milliseconds fill a round's seconds of waiting so, where one allowance filled
  little.

The passes read what the inner loop trains, so nothing may write it while one runs: `stop` ends the work after the
pass in flight and returns once it is done. The round calls it before it writes what the passes read
(node.lowcomm.rounds, `before_write`: the outer step and a download write the parameters; the round's end writes a
resident copy), and the loop when `step` returns; the thread never outlives the `step` call it was started for. The
batches are the node's own data, never contributors' packets.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch
from hivemind.utils.logging import get_logger

from dtrain.node.train.compute import Batch

logger = get_logger(__name__)


class Ahead:
    def __init__(self, pass_of: Callable[[], Batch], allowance: int,
                 step: Optional[Callable[[Sequence[torch.Tensor]], None]] = None, max_steps: int = 1):
        """`pass_of`: one local batch's pass (node.train.compute.OwnBatches.next), whose sums are its own tensors.
        `allowance`: the samples of one inner update. `step`: an inner update with a mean gradient, made while the
        round runs (a resident inner loop); with it each full allowance is applied at once, up to `max_steps`
        updates a round, else one allowance is held."""
        if allowance < 1:
            raise ValueError(f"allowance must be >= 1 sample, got {allowance!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps!r}")
        self._pass_of, self.allowance = pass_of, allowance
        self._step, self.max_steps = step, max_steps
        self._sums: Optional[list[torch.Tensor]] = None  # what the passes made: their summed gradient
        self.held_samples = 0
        self._loss_sum: Optional[torch.Tensor] = None  # sum(samples * loss) of what is held
        self.steps = 0  # inner updates made (`step`) since the last `take_trained`
        self._trained_samples = 0
        self._trained_loss_sum: Optional[torch.Tensor] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # guards `_thread` against two stops at once
        self.error: Optional[BaseException] = None
        self.samples_total = 0  # samples trained while rounds ran, since start

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _room(self) -> bool:
        if self._step is not None:
            return self.steps < self.max_steps
        return self.held_samples < self.allowance

    def start(self, max_steps: Optional[int] = None) -> bool:
        """Begin passes on a thread of their own, if the allowance has room; returns whether it did. `max_steps`:
        the inner updates (`step`) this round may make, if not the last ones given."""
        if max_steps is not None:
            if max_steps < 1:
                raise ValueError(f"max_steps must be >= 1, got {max_steps!r}")
            self.max_steps = max_steps
        if self._thread is not None or not self._room():
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

    def take_trained(self) -> tuple[int, Optional[torch.Tensor]]:
        """The samples the inner updates made while rounds ran (`step`) and their mean loss, counted once: they
        start the next round. Only once stopped."""
        if self._thread is not None:
            raise RuntimeError("take_trained() while the passes run")
        samples, loss_sum = self._trained_samples, self._trained_loss_sum
        self._trained_samples, self._trained_loss_sum, self.steps = 0, None, 0
        return samples, (loss_sum / samples if samples else None)

    def take(self) -> Optional[Batch]:
        """What the passes made and no inner update applied, as one batch (its loss the samples' mean), and nothing
        held any more. Only once stopped."""
        if self._thread is not None:
            raise RuntimeError("take() while the passes run")
        if self._sums is None:
            return None
        batch = Batch(self._sums, self.held_samples, self._loss_sum / self.held_samples)
        self._sums, self.held_samples, self._loss_sum = None, 0, None
        return batch

    def _run(self) -> None:
        try:
            while not self._stopping.is_set() and self._room():
                self._add(self._pass_of())
                if self._step is not None and self.held_samples >= self.allowance:
                    self._apply()
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

    def _apply(self) -> None:
        """The held batches' mean gradient, one inner update (the pending gradient's `drain` arithmetic)."""
        sums, samples, loss_sum = self._sums, self.held_samples, self._loss_sum
        self._sums, self.held_samples, self._loss_sum = None, 0, None
        torch._foreach_div_(sums, samples)
        self._step(sums)
        del sums
        self.steps += 1
        self._trained_samples += samples
        self._trained_loss_sum = loss_sum if self._trained_loss_sum is None else self._trained_loss_sum + loss_sum
