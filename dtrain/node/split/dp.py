"""Differential privacy on split-inference hidden states: the Gaussian mechanism with per-position clipping.

Each position's hidden state is clipped to L2 norm `clip`, then N(0, sigma^2) noise is added to every
coordinate, with `sigma = clip * sqrt(2 ln(1.25 / delta)) / epsilon` (Dwork & Roth, Theorem A.1).
With clip 1, epsilon 1, delta 1e-5 this is the protocol's 4.8448. Epsilon 0 means "noise off".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


def dp_sigma(clip: float, epsilon: float, delta: float) -> float:
    """Noise standard deviation of the Gaussian mechanism; 0.0 when `epsilon` is 0 (noise off)."""
    _check(clip, epsilon, delta)
    if epsilon == 0:
        return 0.0
    return clip * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def clip_rows(h: torch.Tensor, clip: float) -> torch.Tensor:
    """`h` [T, d] with every row scaled down (never up) to L2 norm at most `clip`."""
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip!r}")
    norms = torch.linalg.vector_norm(h, dim=-1, keepdim=True)  # (T, 1)
    factor = torch.clamp(clip / norms.clamp_min(torch.finfo(h.dtype).tiny), max=1.0)
    return h * factor


def clip_and_noise(
    h: torch.Tensor, clip: float, sigma: float, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Clip each row of `h` [T, d] to L2 norm `clip`, then add N(0, sigma^2) noise to every coordinate."""
    if h.ndim != 2:
        raise ValueError(f"expected hidden states [T, d], got shape {tuple(h.shape)}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma!r}")
    clipped = clip_rows(h, clip)
    if sigma == 0:
        return clipped
    noise = torch.randn(h.shape, generator=generator, dtype=h.dtype, device=h.device)
    return clipped + noise * sigma


@dataclass(frozen=True)
class DPConfig:
    """The node's DP option for split inference."""

    clip: float = 1.0  # per-position L2 clipping bound C of the hidden state
    epsilon: float = 0.0  # privacy budget per forward call; 0 turns clipping and noise off
    delta: float = 1e-5  # failure probability of the (epsilon, delta) guarantee

    def __post_init__(self):
        _check(self.clip, self.epsilon, self.delta)

    @property
    def sigma(self) -> float:
        return dp_sigma(self.clip, self.epsilon, self.delta)

    @property
    def enabled(self) -> bool:
        return self.epsilon > 0

    def apply(self, h: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Clipped and noised `h` when enabled; `h` itself (the same tensor, untouched) when not."""
        if not self.enabled:
            return h
        return clip_and_noise(h, self.clip, self.sigma, generator)


def _check(clip: float, epsilon: float, delta: float) -> None:
    if not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
        raise ValueError(f"DP clip must be a finite number > 0, got {clip!r}")
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"DP epsilon must be a finite number >= 0 (0 turns noise off), got {epsilon!r}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"DP delta must lie in (0, 1), got {delta!r}")
