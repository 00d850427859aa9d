"""The arithmetic of robust aggregation (robust.py), pure numpy, with no configuration and no state.

One hand-over's contributions become, per tensor touched, an `(n, union)` float32 matrix over the union of the
coordinates its contributions touch (absent coordinates are zeros, as they are in the sum), in a canonical order; the
statistics robust.py judges with are taken over those matrices' rows: L2 norms, cosines with a reference, near-copies,
CenteredClip's centre and the coordinate-wise trimmed mean. robust.py decides which of them apply and with what
bounds; here they are numbers in, numbers out, each readable without the policy around it.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import numpy as np

from dtrain.node.contribution import Contribution

SPARSE_UNION_FRACTION = 8  # _coordinates sorts the indices sent when they are under 1/8 of the tensor


def _digest(c: Contribution) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for s in c.sections:
        h.update(np.int64(s.tensor_id).tobytes())
        if s.indices is not None:
            h.update(np.ascontiguousarray(s.indices).tobytes())
        h.update(np.ascontiguousarray(s.values).tobytes())
    return h.digest()


def canonical(contributions: Sequence[Contribution]) -> list[Contribution]:
    """A fixed order, so that float sums, and so the result, do not depend on arrival order."""
    key = lambda c: (c.contributor, c.step, c.samples, c.loss)  # noqa: E731
    cheap = [key(c) for c in contributions]
    if len(set(cheap)) == len(cheap):
        return sorted(contributions, key=key)
    return sorted(contributions, key=lambda c: (*key(c), _digest(c)))  # ties: by content


def union_matrices(contributions: Sequence[Contribution], tensor_elements: Sequence[int]
                   ) -> list[tuple[int, Optional[np.ndarray], np.ndarray]]:
    """Per tensor touched by anyone, in tensor order: (tensor id, coordinates or None for all, float32
    [n, len(coordinates)]), row i being `contributions[i]`."""
    n = len(contributions)
    by_tensor: dict[int, list] = {}
    for row, c in enumerate(contributions):
        for s in c.sections:
            by_tensor.setdefault(int(s.tensor_id), []).append((row, s))
    out = []
    for tid in sorted(by_tensor):
        parts = by_tensor[tid]
        elements = int(tensor_elements[tid])
        if any(s.indices is None for _, s in parts):
            coords, positions = None, [s.indices for _, s in parts]
        else:
            coords, positions = _coordinates([s for _, s in parts], elements)
        x = np.zeros((n, elements if coords is None else coords.size), np.float32)
        for (row, s), pos in zip(parts, positions):
            if s.indices is None:
                x[row] += s.values
                continue
            if s.unique:
                x[row, pos] += s.values
            else:
                np.add.at(x[row], pos, s.values)  # Mode 1 repeats add up
        out.append((tid, coords, x))
    return out


def _coordinates(sections: Sequence, elements: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The elements of a tensor that sparse `sections` touch (sorted, unique), and where each section's indices lie
    among them. Sparse enough (the indices sent, all sections together, under 1/SPARSE_UNION_FRACTION of the
    tensor): sorted, in O(k log k) of the k indices. Else a mask over the tensor and its running count, O(elements):
    not np.unique, whose hash-based version in numpy 2.3 took 9 s for ten 1% packets of the default model, the mask
    0.1 s. The mask alone made one 4 MB Mode 2 packet of GPT-2 small cost 0.6 s to aggregate (a mask and a cumsum
    over all 124M elements, for 1.3M entries)."""
    indices = [s.indices for s in sections]
    if sum(i.size for i in indices) * SPARSE_UNION_FRACTION < elements:
        if len(sections) == 1 and sections[0].unique:  # DGRD Mode 2: strictly increasing already
            return indices[0], [np.arange(indices[0].size)]
        merged = np.sort(np.concatenate(indices))
        coords = merged[np.concatenate(([True], merged[1:] != merged[:-1]))]
        return coords, [np.searchsorted(coords, i) for i in indices]
    mask = np.zeros(elements, bool)
    for i in indices:
        mask[i] = True
    where = np.cumsum(mask, dtype=np.int64 if elements >= 2**31 else np.int32)  # 1 + position in coords
    return np.flatnonzero(mask), [where[i] - 1 for i in indices]


def row_norms(mats, center=None) -> np.ndarray:
    """L2 norm of every row over all tensors (float64: 3e38-sized entries must not overflow)."""
    sq = np.zeros(mats[0][2].shape[0] if mats else 0, np.float64)
    for i, (_, _, x) in enumerate(mats):
        d = x if center is None else x - center[i]
        sq += np.einsum("ij,ij->i", d, d, dtype=np.float64)
    return np.sqrt(sq)

def duplicates(mats, norms: np.ndarray, w: np.ndarray, threshold: float) -> np.ndarray:
    """Rows that are near-copies (cosine above `threshold`) of a counted row. Of each group the smallest (by L2 norm
    as sent, then canonical order) counts: a copy of someone else's packet, scaled, never displaces it."""
    n = norms.size
    gram = np.zeros((n, n), np.float64)
    for _, _, x in mats:
        x64 = x.astype(np.float64)
        gram += x64 @ x64.T
    scale = np.sqrt(np.maximum(np.diag(gram), 0.0))  # norms of the rows as they are now (clipped)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = gram / np.outer(scale, scale)
    dup = np.zeros(n, bool)
    for i in sorted(range(n), key=lambda r: (norms[r], r)):
        if dup[i] or w[i] <= 0 or not scale[i] > 0:
            continue
        near = (cos[i] > threshold) & (w > 0)
        near[i] = False
        dup |= near
    return dup


def centered_clip(mats, w: np.ndarray, tau_multiple: float, iterations: int
                  ) -> tuple[list[np.ndarray], np.ndarray, bool]:
    """Per tensor the weighted CenteredClip centre (radius `tau_multiple` x the median distance from the weighted
    mean, at most `iterations` passes); the last c_i; whether it is exactly the plain mean."""
    total = float(w.sum())
    w32 = w.astype(np.float32)
    center = [np.dot(w32, x) / np.float32(total) for _, _, x in mats]
    dist = row_norms(mats, center)
    tau = tau_multiple * float(np.median(dist))
    c = np.ones(len(w))
    for it in range(iterations):
        if it:
            dist = row_norms(mats, center)
        with np.errstate(divide="ignore"):
            c = np.where(dist > tau, tau / np.maximum(dist, 1e-300), 1.0)
        if (c >= 1.0).all():
            return center, c, it == 0  # at the mean's fixed point: the centre is the weighted mean
        wc = (w * c).astype(np.float32)
        step_sq = 0.0
        for i, (_, _, x) in enumerate(mats):
            step = (np.dot(wc, x) - np.float32(wc.sum()) * center[i]) / np.float32(total)
            center[i] = center[i] + step
            step_sq += float(np.dot(step.astype(np.float64), step))
        if np.sqrt(step_sq) <= 1e-6 * max(tau, 1e-30):
            break
    return center, c, False


def trimmed_mean(x: np.ndarray, w: np.ndarray, fraction: float) -> np.ndarray:
    """Coordinate-wise: drop floor(fraction * n) values at each end, weighted mean of the rest."""
    n = x.shape[0]
    k = int(np.floor(fraction * n))
    if k == 0:
        return np.dot(w.astype(np.float32), x) / np.float32(w.sum())
    order = np.argsort(x, axis=0, kind="stable")[k:n - k]  # (n - 2k, U)
    kept = np.take_along_axis(x, order, axis=0)
    kw = w.astype(np.float32)[order]
    return (kw * kept).sum(axis=0) / kw.sum(axis=0)


def cosines(mats, norms: np.ndarray, reference: Sequence[np.ndarray]) -> np.ndarray:
    """Cosine of every row with `reference` (flat per tensor; zero outside the union, as the rows are); nan when
    either is zero."""
    ref_norm = np.sqrt(sum(float(np.dot(r.astype(np.float64), r)) for r in reference))
    dots = np.zeros(norms.size, np.float64)
    for tid, coords, x in mats:
        r = reference[tid] if coords is None else reference[tid][coords]
        dots += x.astype(np.float64) @ r.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((norms > 0) & (ref_norm > 0), dots / (norms * ref_norm), np.nan)


def keep_rows(mats, keep: np.ndarray):
    """The union matrices with only the rows `keep` marks."""
    return [(tid, coords, x[keep]) for tid, coords, x in mats]
