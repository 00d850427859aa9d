"""The node's split-inference options (`dtrain-node` flags in the "split inference" group)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from node.split.dp import DPConfig


@dataclass(frozen=True)
class SplitConfig:
    """How a node serves split inference; every field maps onto one `dtrain-node` flag."""

    max_sessions: int = 32  # KV-cached sessions kept at once (LRU beyond this)
    session_ttl_s: float = 300.0  # a session idle this long is forgotten, seconds
    dp_clip: float = 1.0  # per-position L2 clipping bound C of the returned hidden state
    dp_epsilon: float = 0.0  # Gaussian-mechanism epsilon per forward call; 0 turns clipping and noise off
    dp_delta: float = 1e-5  # failure probability of the (epsilon, delta) guarantee
    experts: tuple[tuple[str, str], ...] = ()  # (name, directory written by LoraExpert.save) per hosted expert
    he: bool = True  # compute expert deltas under CKKS when a request asks for use_he
    split_model: Optional[str] = None  # local transformers causal-LM directory to serve (frozen) instead of the shared model
    max_frame_bytes: Optional[int] = None  # largest request accepted, bytes; None: enough for max_seq_len positions
    forward_timeout_s: float = 120.0  # bound on one forward call, seconds
    workers: int = 4  # threads running forward calls, so sessions proceed side by side

    def __post_init__(self):
        if not isinstance(self.max_sessions, int) or self.max_sessions < 1:
            raise ValueError(f"split: max_sessions must be a positive integer, got {self.max_sessions!r}")
        if not (isinstance(self.session_ttl_s, (int, float)) and self.session_ttl_s > 0):
            raise ValueError(f"split: session_ttl_s must be > 0 seconds, got {self.session_ttl_s!r}")
        self.dp  # DPConfig validates clip, epsilon and delta
        names = [name for name, _ in self.experts]
        for name, path in self.experts:
            if not name or not path:
                raise ValueError(f"split: expert needs NAME=PATH, got {name!r}={path!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"split: expert names must be unique, got {names}")
        if self.max_frame_bytes is not None and (not isinstance(self.max_frame_bytes, int) or self.max_frame_bytes < 1024):
            raise ValueError(f"split: max_frame_bytes must be an integer >= 1024, got {self.max_frame_bytes!r}")
        if not (isinstance(self.forward_timeout_s, (int, float)) and math.isfinite(self.forward_timeout_s)
                and self.forward_timeout_s > 0):
            raise ValueError(f"split: forward_timeout_s must be > 0 seconds, got {self.forward_timeout_s!r}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"split: workers must be a positive integer, got {self.workers!r}")

    @property
    def dp(self) -> DPConfig:
        return DPConfig(clip=float(self.dp_clip), epsilon=float(self.dp_epsilon), delta=float(self.dp_delta))

    def frame_limit(self, max_seq_len: int, hidden_dim: int) -> int:
        """Largest request body / WebSocket message accepted, bytes."""
        if self.max_frame_bytes is not None:
            return self.max_frame_bytes
        # base64 of the largest hidden_states (4/3 of the float32 bytes) plus room for the JSON fields
        return (max_seq_len * hidden_dim * 4 + 2) // 3 * 4 + 64 * 1024


def parse_expert_flag(value: str) -> tuple[str, str]:
    """`NAME=PATH` -> (name, path)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--expert takes NAME=PATH (a directory written by LoraExpert.save), got {value!r}")
    return name, path
