"""The node's split-inference options (`dtrain-node` flags in the "split inference" group)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from dtrain.node.options import option
from dtrain.node.split.dp import DPConfig


@dataclass(frozen=True)
class SplitConfig:
    """How a node serves split inference; every field maps onto one `dtrain-node` flag."""

    max_sessions: int = option(32, "--split-max-sessions", "KV-cached split sessions kept at once (LRU beyond)")
    session_ttl_s: float = option(300.0, "--split-session-ttl", "seconds an idle split session is kept")
    dp_clip: float = option(1.0, "--dp-clip", "L2 clipping bound C of each returned hidden state")
    dp_epsilon: float = option(0.0, "--dp-epsilon", "DP epsilon per forward call; 0 turns clipping and noise off")
    dp_delta: float = option(1e-5, "--dp-delta", "DP delta: failure probability of the guarantee")
    # (name, directory written by LoraExpert.save) per hosted expert
    experts: tuple[tuple[str, str], ...] = option(
        (), "--expert", "host a LoRA expert saved by LoraExpert.save / examples/train_expert.py (repeatable)",
        action="append", metavar="NAME=PATH", dest="expert")
    he: bool = option(True, "--no-he", "compute expert deltas in plaintext only (no CKKS keys)",
                      without="a node that hosts an --expert makes CKKS keys at start and computes the expert's "
                      "delta under CKKS for a request that sets use_he", action="store_false", dest="he")
    split_model: Optional[str] = option(None, "--split-model", "serve this local transformers causal-LM directory "
                                                               "(frozen) instead of the shared model", metavar="PATH")
    max_frame_bytes: Optional[int] = option(None, "--split-max-frame-bytes", "largest split request, bytes "
                                                                              "(default: enough for max_seq_len)")
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
