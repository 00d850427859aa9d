"""Robust aggregation of the browser contributions of one hand-over.

One hand-over's `Contribution`s go in; out comes what the node's bookkeeping already expects, the flat
float32 `sum(w_i * g_i)` per tensor, the total weight and the weighted loss sum, so `sums / samples` stays
the mean the swarm averages. Three defences, each a no-op for honest contributions of comparable size
(NOTES.md, "Swarm soundness": then the result is the samples-weighted mean to float32 precision):

1. Bounded weight: a packet's `samples` above `max_weight_multiple` x the hand-over's median is counted
   as that much (the bridge's gate already refuses `samples` above `max_samples_per_packet`).
2. Bounded magnitude: each gradient is scaled down to the L2 norm bound, `clip_multiple` x the running
   median of recent norms (`NormTracker`), or a fixed `norm_bound`; never above `clip_multiple` x this
   hand-over's own median norm when it has at least `MIN_FOR_MEDIAN` contributions.
3. Direction check (opt-in, `min_cosine`): a gradient whose cosine with a reference direction (the node passes
   its Adam first moment, exp_avg: the swarm's recent direction) is below `min_cosine` counts with weight 0.
   No statistic of one hand-over tells a sign-flipped top-1% packet apart (its norm and its distance from the
   others are honest ones); its direction against history does (docs/robustness.md). Off by default: an honest
   gradient may point against the momentum (an overshoot, a new kind of batch), and NOTES.md wants its exact mean.
4. Robust centre: CenteredClip (Karimireddy et al. 2021, as used by BTARD-SGD, Gorbunov et al. 2022):
   `v <- v + sum_i w_i c_i (g_i - v) / sum_i w_i` with `c_i = min(1, tau / |g_i - v|)`. When no `c_i` is
   below 1 the fixed point is exactly the weighted mean, and that is what is returned. `trimmed_mean`
   (coordinate-wise, over contributions) is the alternative; it changes honest results too.

Sparse packets stay sparse: every tensor is worked on over the union of the coordinates its contributions
touch (absent coordinates are zeros, as they are in the sum), as an `(n, union)` float32 matrix. Those matrices and
the statistics over their rows (norms, cosines, near-copies, CenteredClip, the trimmed mean) are robust_stats.py;
this module is the policy: which defences apply, with what bounds, and the norm history they are taken against.

What this bounds and what not: one packet's weight and norm, and the pull of a minority of contributions in
one hand-over towards any point (CenteredClip moves the result by at most about `fraction x tau`); with the
direction check, any component against the reference beyond `|min_cosine|` of a packet's norm. It
does not bound a majority (one party behind many `node_id`s: Sybils), an attacker that stays inside the
honest spread ("a little is enough" moves the result by up to that spread), or a malicious hivemind *peer*
inside the all-reduce, which never passes through this code.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
from hivemind.utils.logging import get_logger

from dtrain.node.contribution import Contribution
from dtrain.node.train.robust_stats import (canonical, centered_clip, cosines, duplicates, keep_rows, row_norms,
                                            trimmed_mean, union_matrices)

logger = get_logger(__name__)

METHODS = ("centered_clip", "trimmed_mean", "mean")
MIN_FOR_MEDIAN = 3  # contributions a hand-over needs before its own median says anything about honest norms


class RobustConfigError(ValueError):
    """A robust-aggregation option out of range; the message names it and the valid range."""


@dataclass(frozen=True)
class RobustConfig:
    """How one hand-over's contributions are combined. The defaults leave honest hand-overs unchanged."""

    # centered_clip | trimmed_mean | mean. CenteredClip by default: it is the only one of the three that
    # is exactly the weighted mean when nobody is far out (trimmed_mean always drops honest tails) and it
    # bounds a minority's pull; "mean" keeps only the weight and norm bounds below.
    method: str = "centered_clip"
    # Norm bound as a multiple of the running median L2 norm (unitless); 0 turns adaptive clipping off.
    # 4x leaves the spread of honest gradient norms alone (see bench/bench_robust.py).
    clip_multiple: float = 4.0
    # Fixed L2 norm bound (gradient units); None: adaptive. Overrides clip_multiple's history bound.
    norm_bound: Optional[float] = None
    # Recent norms the running median is taken over (contributions); bounded so an attacker's old
    # packets age out and memory stays fixed.
    norm_window: int = 512
    # Norms seen before the running median is trusted (contributions).
    min_norms: int = 16
    # L2 norm bound until min_norms norms were seen (gradient units); None: no history bound in warm-up.
    # GPT-2-style models at initialisation send norms of about 0.5-5 (bench/bench_robust.py); 100 leaves
    # honest warm-up alone and still stops a x1000 packet from taking the first update.
    warmup_norm_bound: Optional[float] = 100.0
    # CenteredClip radius as a multiple of the median distance of the contributions from their clipped
    # mean (unitless): honest contributions of comparable size sit well within 3x of it.
    tau_multiple: float = 3.0
    # CenteredClip iterations at most (each is one pass over the union matrix).
    iterations: int = 10
    # Fraction of contributions dropped at each end, per coordinate, by trimmed_mean (0 .. <0.5).
    trim_fraction: float = 0.2
    # A contribution's weight is at most this multiple of the median samples (unitless), of the hand-over
    # (with MIN_FOR_MEDIAN contributions or more) and of recent history (once min_norms were seen); 0: off.
    # On by default: a claimed `samples` is a claim. 4x leaves honest browsers that train up to four times the
    # usual batch their exact weighted mean, and lets a packet claiming the gate's largest `samples` (256, when
    # browsers train 2) count as 8 samples, not 256 (bench/bench_robust.py, docs/robustness.md).
    max_weight_multiple: float = 4.0
    # A contribution's weight is at most this many samples whatever the medians say; None: no fixed cap.
    # The node passes its max_samples_per_packet, so it holds even for packets that bypassed the gate.
    max_samples: Optional[int] = None
    # A contribution whose cosine with the reference direction is not above this counts with weight 0 (unitless,
    # -1 .. <1); None: no direction check. The node sets it to 0 when it has a trusted reference (its own gradient,
    # FLTrust's ReLU(cosine) gate); against the Adam momentum (no reference) it is opt-in (module docstring).
    min_cosine: Optional[float] = None
    # With a trusted reference: each contribution's L2 norm is clipped to this multiple of the reference's norm
    # (unitless; 0: no such bound). FLTrust normalises every update to the reference norm; a bound instead leaves
    # honest packets alone: top-k packets with error feedback carry their residual, and measured 3-4x the norm of the
    # node's dense batch-4 gradient (bench/bench_robust.py), so 8x. Unlike the history bound, no one but the node
    # writes it.
    reference_norm_multiple: float = 8.0
    # Contributions of one hand-over whose cosine with each other is above this count once (the first in canonical
    # order keeps its weight, the others count 0): one party sending the same gradient through many node_ids, or
    # "a little is enough" attackers sending one computed vector. Honest packets of different batches share a few
    # coordinates (cosine near 0). None: off.
    duplicate_cosine: Optional[float] = 0.99
    # Reported train_loss is clamped to [0, max_loss] (nats): cross-entropy is never negative, and one
    # packet must not move the loss history anywhere.
    max_loss: float = 100.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise RobustConfigError(f"robust method must be one of {METHODS}, got {self.method!r}")
        if self.clip_multiple < 0 or self.max_weight_multiple < 0:
            raise RobustConfigError("clip_multiple and max_weight_multiple must be >= 0 (0 turns them off)")
        if self.norm_bound is not None and not self.norm_bound > 0:
            raise RobustConfigError(f"norm_bound must be > 0 or None, got {self.norm_bound!r}")
        if self.warmup_norm_bound is not None and not self.warmup_norm_bound > 0:
            raise RobustConfigError(f"warmup_norm_bound must be > 0 or None, got {self.warmup_norm_bound!r}")
        if self.norm_window < 1 or not 1 <= self.min_norms <= self.norm_window:
            raise RobustConfigError(f"need norm_window >= 1 and 1 <= min_norms <= norm_window, got "
                                    f"{self.norm_window} and {self.min_norms}")
        if not self.tau_multiple > 0 or self.iterations < 1:
            raise RobustConfigError("tau_multiple must be > 0 and iterations >= 1")
        if not 0 <= self.trim_fraction < 0.5:
            raise RobustConfigError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        if not self.max_loss > 0:
            raise RobustConfigError(f"max_loss must be > 0, got {self.max_loss}")
        if self.min_cosine is not None and not -1.0 <= self.min_cosine < 1.0:
            raise RobustConfigError(f"min_cosine must be in [-1, 1) or None, got {self.min_cosine!r}")
        if self.reference_norm_multiple < 0:
            raise RobustConfigError(f"reference_norm_multiple must be >= 0, got {self.reference_norm_multiple!r}")
        if self.duplicate_cosine is not None and not 0 < self.duplicate_cosine <= 1:
            raise RobustConfigError(f"duplicate_cosine must be in (0, 1] or None, got {self.duplicate_cosine!r}")
        if self.max_samples is not None and self.max_samples < 1:
            raise RobustConfigError(f"max_samples must be >= 1 or None, got {self.max_samples!r}")

    @classmethod
    def plain(cls) -> "RobustConfig":
        """No defence at all: the plain samples-weighted mean (the spec's single server, unguarded)."""
        return cls(method="mean", clip_multiple=0.0, warmup_norm_bound=None, max_weight_multiple=0.0,
                   reference_norm_multiple=0.0, duplicate_cosine=None, max_loss=float(np.finfo(np.float32).max))


@dataclass(frozen=True)
class ContributorReport:
    """What aggregation did to one contribution (one packet)."""

    contributor: str  # the packet's node_id
    samples: int  # samples the packet claimed
    weight: int  # samples it was counted with (after the weight bound)
    norm: float  # L2 norm of its gradient as sent (float64)
    clip_factor: float  # scale of the norm bound, 1.0: not clipped
    center_factor: float  # CenteredClip's c_i in the last iteration (1.0: pulled in fully); 1.0 for other methods
    cosine: Optional[float]  # with the reference direction (weight 0 below min_cosine); None: not checked
    outlier: bool  # any of the above changed its share, or its loss was clamped
    duplicate: bool = False  # counted 0: a near-copy of another contribution of the hand-over (duplicate_cosine)
    trusted: bool = False  # `cosine` is against the node's own gradient (a trusted reference), not its momentum


@dataclass(frozen=True)
class Aggregate:
    """One hand-over's robust aggregate, in the units of the node's existing bookkeeping.

    It is as sparse as the hand-over: `parts` holds only the elements some contribution touched, so adding it costs
    what the packets hold, not the model's size (`sums` is the dense form, made when read)."""

    # (tensor id, its touched elements or None for all of them, float32 samples x the robust mean there), per
    # tensor touched; every other element of the aggregate is 0
    parts: tuple[tuple[int, Optional[np.ndarray], np.ndarray], ...]
    tensor_elements: tuple[int, ...]
    samples: int  # total weight; sums / samples is the mean
    loss_sum: float  # sum of weight x (clamped) train_loss
    norm_bound: Optional[float]  # the L2 bound applied (None: none)
    method: str
    reports: tuple[ContributorReport, ...]  # in canonical (sorted) order, one per contribution

    @property
    def sums(self) -> tuple[np.ndarray, ...]:
        """Per tensor, flat float32: samples x the robust mean gradient (zeros where nobody sent anything)."""
        sums = [np.zeros(n, np.float32) for n in self.tensor_elements]
        for tid, coords, values in self.parts:
            sums[tid][slice(None) if coords is None else coords] = values
        return tuple(sums)

    @property
    def outliers(self) -> tuple[ContributorReport, ...]:
        return tuple(r for r in self.reports if r.outlier)


# ---------------------------------------------------------------------------------------------------------
# the pure function


def _weights(samples: np.ndarray, config: RobustConfig, samples_bound: Optional[int],
             ramps: Optional[np.ndarray] = None) -> np.ndarray:
    """Each claimed `samples` bounded: by `max_samples`, and by `max_weight_multiple` x the median samples (of recent
    history, `samples_bound`, and of this hand-over). `ramps` (per contribution, 0..1: how far its contributor's
    record has earned the full multiple) shrinks the median bound of a contributor with no record yet to 1x the
    median: a new node_id counts as much as a typical contributor, never more."""
    fixed = config.max_samples
    median_caps = [float(samples_bound)] if samples_bound is not None else []
    if config.max_weight_multiple > 0 and samples.size >= MIN_FOR_MEDIAN:
        median_caps.append(config.max_weight_multiple * float(np.median(samples)))
    caps = np.full(samples.size, np.inf)
    if median_caps:
        cap = min(median_caps)
        if ramps is not None and config.max_weight_multiple > 1:
            m = config.max_weight_multiple
            cap = cap * (1.0 + (m - 1.0) * np.clip(ramps, 0.0, 1.0)) / m
        caps = np.maximum(1.0, np.floor(np.broadcast_to(cap, samples.shape)))
    if fixed is not None:
        caps = np.minimum(caps, fixed)
    return np.where(np.isfinite(caps), np.minimum(samples, caps), samples).astype(np.int64)


def aggregate(contributions: Sequence[Contribution], tensor_elements: Sequence[int],
              config: RobustConfig = RobustConfig(), norm_bound: Optional[float] = None,
              samples_bound: Optional[int] = None, reference: Optional[Sequence[np.ndarray]] = None,
              trusted: bool = False, ramps: Optional[Mapping[str, float]] = None,
              excluded: frozenset = frozenset()) -> Aggregate:
    """Combine one hand-over's contributions. Pure: same inputs (in any order), same output.

    `norm_bound` and `samples_bound` come from the history (`NormTracker.bound()`, `.samples_bound()`),
    None for none; a hand-over of at least `MIN_FOR_MEDIAN` contributions is also bounded by its own
    medians (`clip_multiple` x its median norm, `max_weight_multiple` x its median samples). `reference` (flat
    float32 per tensor) is the direction `min_cosine` checks against; None, or all zeros, checks nothing. `trusted`:
    the reference is the node's own gradient (reference.py), so each norm is also bounded by
    `reference_norm_multiple` x its norm. `ramps`: per contributor, how much of the weight multiple its record earned
    (0..1, missing: 1). `excluded`: contributors whose contributions count 0 (scored out by the ledger).
    """
    elements = tuple(int(e) for e in tensor_elements)
    if not contributions:
        return Aggregate((), elements, 0, 0.0, norm_bound, config.method, ())
    contribs = canonical(contributions)
    n = len(contribs)
    claimed = np.array([c.samples for c in contribs], np.int64)
    is_own = np.array([c.own for c in contribs], bool)  # the node's own: judged by nothing but the bounds
    ramp = None if ramps is None else np.array([1.0 if c.own else ramps.get(c.contributor, 1.0) for c in contribs],
                                               np.float64)
    w = _weights(claimed, config, samples_bound, ramp)
    w = np.where([c.contributor in excluded and not c.own for c in contribs], 0, w)
    losses = np.array([c.loss for c in contribs], np.float64)
    clamped = np.clip(losses, 0.0, config.max_loss)

    mats = union_matrices(contribs, tensor_elements)
    norms = row_norms(mats) if mats else np.zeros(n)
    cosine = np.full(n, np.nan)
    checked = config.min_cosine is not None and reference is not None and bool(mats)
    if checked:
        cosine = np.where(is_own, np.nan, cosines(mats, norms, reference))  # before clipping: the packets as sent
    bound = norm_bound
    if config.clip_multiple > 0 and n >= MIN_FOR_MEDIAN:
        own = config.clip_multiple * float(np.median(norms))
        if own > 0:
            bound = own if bound is None else min(bound, own)
    if trusted and reference is not None and config.reference_norm_multiple > 0:
        ref_norm = config.reference_norm_multiple * float(np.sqrt(sum(float(np.dot(r.astype(np.float64), r))
                                                                     for r in reference)))
        if ref_norm > 0 and np.isfinite(ref_norm):
            bound = ref_norm if bound is None else min(bound, ref_norm)
    clip = np.ones(n)
    if bound is not None:
        clip = np.where(norms > bound, bound / np.maximum(norms, 1e-300), 1.0)
        if (clip < 1).any():
            for _, _, x in mats:
                x *= clip.astype(np.float32)[:, None]

    if checked:
        w = np.where(cosine <= config.min_cosine if trusted else cosine < config.min_cosine, 0, w)  # nan never drops
    duplicate = np.zeros(n, bool)
    if config.duplicate_cosine is not None and n >= 2 and mats:
        duplicate = duplicates(mats, norms, w, config.duplicate_cosine) & ~is_own
        w = np.where(duplicate, 0, w)
    keep = w > 0
    center_factor = np.ones(n)
    total = int(w.sum())
    parts = []
    if keep.any():
        kept, wk = (mats, w) if keep.all() else (keep_rows(mats, keep), w[keep])
        w32 = wk.astype(np.float32)
        if config.method == "mean" or wk.size == 1:
            results = [np.dot(w32, x) for _, _, x in kept]  # already sum(w_i g_i)
        elif config.method == "centered_clip":
            center, factors, exact = centered_clip(kept, wk, config.tau_multiple, config.iterations)
            center_factor[keep] = factors
            if exact:
                results = [np.dot(w32, x) for _, _, x in kept]
            else:
                results = [np.float32(total) * v for v in center]
        else:
            results = [np.float32(total) * trimmed_mean(x, wk, config.trim_fraction) for _, _, x in kept]
        parts = [(tid, coords, r) for (tid, coords, _), r in zip(kept, results)]

    reports = tuple(
        ContributorReport(contributor=c.contributor, samples=int(claimed[i]), weight=int(w[i]),
                          norm=float(norms[i]), clip_factor=float(clip[i]),
                          center_factor=float(center_factor[i]),
                          cosine=None if np.isnan(cosine[i]) else float(cosine[i]),
                          outlier=bool(w[i] < claimed[i] or clip[i] < 1 or center_factor[i] < 1
                                       or clamped[i] != losses[i]),
                          duplicate=bool(duplicate[i]), trusted=bool(checked and trusted))
        for i, c in enumerate(contribs))
    return Aggregate(tuple(parts), elements, total, float(np.dot(w.astype(np.float64), clamped)), bound, config.method,
                     reports)


# ---------------------------------------------------------------------------------------------------------
# state: the running norm bound, and the wrapper the node calls once per hand-over


class NormTracker:
    """Running median of recent contribution norms, the basis of the adaptive L2 bound. Thread-safe.

    What goes in is each norm capped at the bound in force, one per contribution: a minority of attackers
    can move the median only within the honest norms' spread (a median's breakdown point is one half),
    and a majority can raise the bound by at most `clip_multiple` per window.
    """

    def __init__(self, config: RobustConfig):
        self.config = config
        self._norms: deque[float] = deque(maxlen=config.norm_window)
        self._samples: deque[int] = deque(maxlen=config.norm_window)  # weights counted, same rules
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._norms)

    def bound(self) -> Optional[float]:
        cfg = self.config
        if cfg.norm_bound is not None:
            return cfg.norm_bound
        if cfg.clip_multiple <= 0:
            return None
        with self._lock:
            if len(self._norms) < cfg.min_norms:
                return cfg.warmup_norm_bound
            return cfg.clip_multiple * float(np.median(np.fromiter(self._norms, np.float64)))

    def samples_bound(self) -> Optional[int]:
        """`max_weight_multiple` x the running median of counted samples, once warmed up; else None."""
        cfg = self.config
        if cfg.max_weight_multiple <= 0:
            return None
        with self._lock:
            if len(self._samples) < cfg.min_norms:
                return None
            return max(1, int(cfg.max_weight_multiple * float(np.median(np.fromiter(self._samples, np.float64)))))

    def observe(self, result: Aggregate) -> None:
        bound = result.norm_bound
        norms = [r.norm if bound is None else min(r.norm, bound) for r in result.reports]
        with self._lock:
            self._norms.extend(n for n in norms if np.isfinite(n) and n > 0)
            self._samples.extend(r.weight for r in result.reports if r.weight > 0)  # capped: same argument as norms


class RobustAggregator:
    """`aggregate` plus its norm history and the log lines NOTES.md asks for. One per node."""

    def __init__(self, config: RobustConfig, tensor_elements: Sequence[int]):
        self.config = config
        self.tensor_elements = tuple(int(e) for e in tensor_elements)
        self.tracker = NormTracker(config)

    def aggregate(self, contributions: Sequence[Contribution], reference: Optional[Sequence[np.ndarray]] = None,
                  trusted: bool = False, ramps: Optional[Mapping[str, float]] = None,
                  excluded: frozenset = frozenset()) -> Aggregate:
        """`reference`: the direction the direction check compares with (the node's own gradient when `trusted`,
        else its Adam exp_avg), if it is on; `ramps` and `excluded` come from the contributor ledger."""
        result = aggregate(contributions, self.tensor_elements, self.config, self.tracker.bound(),
                           self.tracker.samples_bound(), reference, trusted, ramps, excluded)
        self.tracker.observe(result)
        for r in result.outliers:
            logger.warning(f"contributor {r.contributor!r}: outlier ({self.config.method}): norm {r.norm:.4g}"
                           f" (bound {result.norm_bound if result.norm_bound is None else f'{result.norm_bound:.4g}'}),"
                           f" clip x{r.clip_factor:.3g}, centre x{r.center_factor:.3g}, cosine {r.cosine},"
                           f" weight {r.weight} of {r.samples} samples")
        return result


def all_finite(tensors: Iterable) -> bool:
    """Whether every element of every tensor (torch or numpy) is finite: the last check before an update
    is published or averaged (parameters and Adam moments)."""
    import torch  # the node has torch; the codec-only users of this module need not import it

    for t in tensors:
        if isinstance(t, torch.Tensor):
            if not bool(torch.isfinite(t).all()):
                return False
        elif not np.isfinite(np.asarray(t)).all():
            return False
    return True


def optimizer_state_tensors(optimizer) -> list:
    """Every tensor in a torch optimizer's state (AdamW: exp_avg, exp_avg_sq, step), for `all_finite`."""
    import torch

    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
