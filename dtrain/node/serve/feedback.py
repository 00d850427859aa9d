"""Feedback that trains: rewarded completions become training contributions of the shared model.

Every `--feedback-interval` seconds the trainer takes up to `--feedback-batch` rewarded rows no contribution used
yet, computes on the node's current snapshot (a model over its own bytes, node.frozen) the gradient of

    L = (1/N) * sum_i |r_i| * l_i,   with r_i the reward clipped to [-1, 1], and over the completion tokens t of i:
      r_i > 0: l_i = mean_t -log p(t)                 (pull: the likelihood of what was rewarded goes up)
      r_i < 0: l_i = mean_t -log(1 - p(t))            (push away: unlikelihood, Welleck et al. 2019)

and submits it through `TrainingNode.submit(Contribution)`, the path a browser's packet takes: the same step
window, robust aggregation (norm bound, CenteredClip), ledger and swarm averaging. Both terms are bounded: the
pull is a cross-entropy, and the push stops pushing once a token is unlikely (its gradient vanishes as p -> 0,
where a negative cross-entropy would grow without bound); 1 - p is clamped at 1e-6. A reward of 0 carries no
signal: its row is marked used and skipped. Only the completion's tokens are trained, given the prompt's, and
the loss is of the snapshot the contribution is for, not of the (possibly older) step that served the row.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from hivemind.utils.logging import get_logger

from dtrain.node.contribution import Contribution, Section
from dtrain.node.frozen import on_snapshot
from dtrain.node.train.pool import StepMismatch
from dtrain.node.serve.capture import CaptureStore, Record

logger = get_logger(__name__)

CONTRIBUTOR = "serve-feedback"  # the node_id feedback contributions carry in the ledger
MIN_ONE_MINUS_P = 1e-6


@dataclass(frozen=True)
class FeedbackRound:
    step: int  # the snapshot step the gradient is for
    records: int  # rows whose reward went into it (samples)
    skipped: int  # rows taken but without signal (reward 0, empty completion)
    loss: float  # L above


def record_loss(model: torch.nn.Module, record: Record, expert=None) -> Optional[torch.Tensor]:
    """|r| * l of one record (a scalar with a graph), or None when it carries no signal.

    With `expert` (a node.split.experts.LoraExpert) the logits are the ones serving computes for `model=<expert>`:
    its delta added to the final hidden state, then the tied LM head (node/serve/adapter.py trains it so)."""
    reward = max(-1.0, min(1.0, float(record.reward or 0.0)))
    if reward == 0.0 or not record.completion_ids:
        return None
    max_len = model.config.max_position_embeddings
    ids = list(record.prompt_ids) + list(record.completion_ids)
    ids = ids[-max_len:]  # served within the context, so this cuts nothing; a guard for foreign rows
    n_completion = min(len(record.completion_ids), len(ids) - 1)
    tokens = torch.tensor([ids], dtype=torch.long)  # (1, T)
    if expert is None:
        logits = model(input_ids=tokens).logits[0, :-1].float()  # (T-1, V): position j predicts token j+1
    else:
        hidden = model.transformer(input_ids=tokens).last_hidden_state  # (1, T, d), after ln_f
        hidden = hidden + expert.delta(hidden)
        logits = model.get_output_embeddings()(hidden)[0, :-1].float()  # (T-1, V)
    targets = tokens[0, 1:]  # (T-1,)
    logp = torch.log_softmax(logits[-n_completion:], dim=-1).gather(1, targets[-n_completion:, None])[:, 0]
    if reward > 0:
        per_token = -logp
    else:
        per_token = -torch.log((1.0 - logp.exp()).clamp_min(MIN_ONE_MINUS_P))
    return abs(reward) * per_token.mean()


def mean_gradient(params: Sequence[torch.Tensor], records: Sequence[Record],
                  loss_of: Callable[[Record], Optional[torch.Tensor]]) -> tuple[list[torch.Tensor], float, int]:
    """(dL/d`params` averaged over the records with signal, L, N); N may be 0. One record at a time: logits of a
    whole batch would not fit memory."""
    sums = [torch.zeros_like(p) for p in params]
    total, used = 0.0, 0
    for record in records:
        loss = loss_of(record)
        if loss is None:
            continue
        for acc, g in zip(sums, torch.autograd.grad(loss, params)):
            acc += g
        total += float(loss.detach())
        used += 1
    if used:
        for acc in sums:
            acc /= used
    return sums, (total / used if used else 0.0), used


def feedback_gradient(model: torch.nn.Module, records: Sequence[Record]) -> tuple[list[np.ndarray], float, int]:
    """(dL/dθ as flat float32 arrays in parameter order, L, N) for the records with signal; N may be 0."""
    grads, loss, used = mean_gradient(list(model.parameters()), records, lambda r: record_loss(model, r))
    return [g.reshape(-1).numpy() for g in grads], loss, used


def run_rounds(run_once: Callable[[], object], stop: threading.Event, interval_s: float, what: str) -> None:
    """A feedback trainer's thread: one round every `interval_s` until `stop`; a failed round is logged, the next
    may succeed."""
    while not stop.wait(interval_s):
        try:
            run_once()
        except Exception as e:
            logger.exception(f"{what} round failed: {e!r}")


class FeedbackTrainer:
    """Turns rewarded rows of the capture store into contributions of `node`, on its own thread."""

    def __init__(self, node, store: CaptureStore, template: torch.nn.Module, batch: int, interval_s: float):
        self._node = node
        self._store = store
        self._template = template  # shapes and tied-parameter layout; never trained itself
        self._batch = batch
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dtrain-feedback", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        run_rounds(self.run_once, self._stop, self._interval_s, "feedback")

    def run_once(self) -> Optional[FeedbackRound]:
        """One round: a contribution from the oldest unused rewarded rows; None when there were none."""
        rows = self._store.untrained_rewarded(self._batch)
        if not rows:
            return None
        snap = self._node.snapshot()
        # its parameters are the snapshot's bytes (node.frozen): differentiated, never written
        model = on_snapshot(self._template, snap.f32, trainable=True)
        grads, loss, used = feedback_gradient(model, [r for _, r in rows])
        keys = [(seq,) for seq, _ in rows]
        if used == 0:
            self._store.mark_trained(keys, snap.step)
            return FeedbackRound(snap.step, 0, len(rows), 0.0)
        contribution = Contribution(CONTRIBUTOR, snap.step, used, loss,
                                    tuple(Section(i, None, g) for i, g in enumerate(grads)), own=True)
        try:
            self._node.submit(contribution)
        except StepMismatch as e:  # the node moved too far while we computed: the rows wait for the next round
            logger.info(f"feedback contribution for step {snap.step} refused ({e}); retrying next round")
            return None
        self._node.ledger.accepted(CONTRIBUTOR, used)  # as the bridge counts an accepted packet
        self._store.mark_trained(keys, snap.step)
        logger.info(f"feedback contribution: {used} rewarded completions, loss {loss:.4f}, step {snap.step}")
        return FeedbackRound(snap.step, used, len(rows) - used, loss)
