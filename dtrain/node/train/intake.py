"""Contributors' hand-overs into the node's pending gradient (training thread only).

A hand-over is the group of contributions the pool (node.train.pool) released together. It is aggregated robustly
(node.train.robust: CenteredClip by default, the exact weighted mean unless someone is far out), judged against the
node's own gradient at this step when it has a trusted reference (node.train.reference), else, with --min-cosine,
against the inner optimizer's Adam momentum; the ledger (node.train.ledger) keeps each contributor's record. What
is left is added to the pending gradient, or nothing at all when the aggregate is not finite.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch
from hivemind.utils.logging import get_logger

from dtrain.node.contribution import Contribution
from dtrain.node.train.gradient import PendingGradient
from dtrain.node.train.ledger import ContributorLedger
from dtrain.node.train.reference import ReferenceSource
from dtrain.node.train.robust import RobustAggregator, all_finite

logger = get_logger(__name__)


class Intake:
    def __init__(self, aggregator: RobustAggregator, ledger: ContributorLedger, gradient: PendingGradient,
                 tensor_elements: Sequence[int], step: Callable[[], int],
                 reference: Optional[ReferenceSource] = None,
                 optimizer: Callable[[], Optional[torch.optim.Optimizer]] = lambda: None):
        """`step`: the served step a reference gradient is computed at; `optimizer`: the AdamW whose momentum is the
        direction check's reference when there is no trusted one (None before the node has one)."""
        self.aggregator, self.ledger, self.gradient = aggregator, ledger, gradient
        self.reference = reference
        self._elements = list(tensor_elements)
        self._step, self._optimizer = step, optimizer

    def add(self, contributions: Sequence[Contribution]) -> None:
        """One hand-over into the pending gradient, or nothing of it if its aggregate would not be finite."""
        ids = {c.contributor for c in contributions}
        reference = None
        if self.reference is not None and self.aggregator.config.min_cosine is not None:
            reference = self.reference.at(self._step())
        if reference is not None:
            result = self.aggregator.aggregate(contributions, reference.gradient, trusted=True,
                                               ramps=self.ledger.ramps(ids), excluded=self.ledger.excluded(ids))
        else:
            result = self.aggregator.aggregate(contributions, self.momentum(), excluded=self.ledger.excluded(ids))
        self.ledger.record_aggregate(result)
        if not all_finite(values for _, _, values in result.parts):  # every other element is 0
            ids = sorted(ids)
            logger.warning(f"Refused a hand-over whose aggregate is not finite; contributors {ids}")
            self.ledger.refused_update(ids)
            return
        self.gradient.add_parts(result.parts, result.samples, result.loss_sum, packets=len(contributions))

    def momentum(self) -> Optional[list[np.ndarray]]:
        """The Adam first moment (exp_avg) per tensor, flat, on the CPU: the reference of the direction check (None
        when it is off). Views where the moments are CPU tensors: the training thread, which alone steps the
        optimizer, is the one reading them; a copy once per hand-over where they live on a GPU."""
        if self.aggregator.config.min_cosine is None or self.reference is not None:
            return None
        opt = self._optimizer()
        if opt is None:
            return None
        params = [p for group in opt.param_groups for p in group["params"]]
        moments = [opt.state.get(p, {}).get("exp_avg") for p in params]
        if len(moments) != len(self._elements) or any(m is None or m.numel() != n
                                                      for m, n in zip(moments, self._elements)):
            return None
        return [m.detach().reshape(-1).cpu().numpy() for m in moments]
