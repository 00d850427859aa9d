"""LoRA experts for split inference: a low-rank residual on the final hidden state.

An expert adds `B (A h) * scale` to each position's final hidden state `h` [d] (A: [r, d], B: [d, r]).
It is a peft LoRA adapter on a d x d linear layer whose base weight is zero, so the wrapped module's
output is exactly the LoRA delta; peft then gives us its initialisation, trainable-parameter marking
and the adapter file format (`save_pretrained` / `from_pretrained`, local directories only).
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import numpy as np
import torch
from torch import nn
from transformers import GPT2LMHeadModel

from dtrain.node.split.kv_cache import SplitError
from hivemind.utils.logging import get_logger

if TYPE_CHECKING:
    import peft

logger = get_logger(__name__)

EXPERT_META_FILE = "expert.json"  # next to peft's adapter files: the name and shape peft does not record
_TARGET = "proj"


class UnknownExpertError(SplitError):
    """The request names an expert this node does not host."""


class ExpertFileError(SplitError):
    """An expert directory is missing files or they do not describe a valid expert."""


class _ZeroResidual(nn.Module):
    """d x d linear map with a zero weight: under LoRA its output is exactly the adapter's delta."""

    def __init__(self, d_model: int):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model, bias=False)
        nn.init.zeros_(self.proj.weight)
        self.proj.weight.requires_grad_(False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)


class LoraExpert:
    """One named LoRA expert; `delta(h)` is `B (A h) * scale` on the last axis of `h`."""

    def __init__(self, name: str, peft_model: "peft.PeftModel", d_model: int):
        if not isinstance(name, str) or not name:
            raise ValueError(f"expert name must be a non-empty string, got {name!r}")
        self.name = name
        self.d_model = d_model
        self.module = peft_model
        self.module.eval()

    # ---- construction

    @classmethod
    def create(cls, name: str, d_model: int, r: int = 8, alpha: float = 16.0, seed: Optional[int] = None) -> "LoraExpert":
        """A fresh expert with peft's initialisation (A random, B zero: the delta starts at 0)."""
        if not isinstance(r, int) or not 1 <= r <= d_model:
            raise ValueError(f"LoRA rank r must be an integer in [1, {d_model}], got {r!r}")
        import peft  # here, not at the top: half a second of every node's start, for experts only
        config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=[_TARGET], lora_dropout=0.0, bias="none")
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            model = peft.get_peft_model(_ZeroResidual(d_model), config)
        return cls(name, model, d_model)

    @classmethod
    def from_matrices(cls, name: str, A: np.ndarray, B: np.ndarray, scale: float) -> "LoraExpert":
        """An expert with the given A [r, d], B [d, r] and scale (alpha is set to scale * r)."""
        A = np.asarray(A, dtype=np.float32)
        B = np.asarray(B, dtype=np.float32)
        if A.ndim != 2 or B.ndim != 2 or B.shape != (A.shape[1], A.shape[0]):
            raise ValueError(f"expected A [r, d] and B [d, r], got A {A.shape} and B {B.shape}")
        r, d = A.shape
        expert = cls.create(name, d, r=r, alpha=float(scale) * r)
        with torch.no_grad():
            expert._lora_A.weight.copy_(torch.from_numpy(A))
            expert._lora_B.weight.copy_(torch.from_numpy(B))
        return expert

    # ---- the adapter's parts

    @property
    def _layer(self):
        return self.module.base_model.model.proj

    @property
    def _adapter(self) -> str:
        return self.module.active_adapter

    @property
    def _lora_A(self) -> nn.Linear:
        return self._layer.lora_A[self._adapter]

    @property
    def _lora_B(self) -> nn.Linear:
        return self._layer.lora_B[self._adapter]

    @property
    def r(self) -> int:
        return self._lora_A.weight.shape[0]

    @property
    def A(self) -> np.ndarray:
        """[r, d] float32 copy."""
        return self._lora_A.weight.detach().to(torch.float32).numpy().copy()

    @property
    def B(self) -> np.ndarray:
        """[d, r] float32 copy."""
        return self._lora_B.weight.detach().to(torch.float32).numpy().copy()

    @property
    def scale(self) -> float:
        return float(self._layer.scaling[self._adapter])

    def parameters(self) -> list[nn.Parameter]:
        """The trainable LoRA parameters (A and B)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    # ---- use

    def delta(self, h: torch.Tensor) -> torch.Tensor:
        """`B (A h) * scale` for `h` [..., d] (differentiable; wrap in no_grad to serve)."""
        if h.shape[-1] != self.d_model:
            raise ValueError(f"expert {self.name!r} expects hidden size {self.d_model}, got {h.shape[-1]}")
        return self.module(h)

    def save(self, path: Path | str) -> None:
        """Write peft's adapter files plus `expert.json` into the directory `path`."""
        path = Path(path)
        self.module.save_pretrained(str(path))
        meta = {"name": self.name, "d_model": self.d_model, "r": self.r, "scale": self.scale}
        (path / EXPERT_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path | str, name: Optional[str] = None) -> "LoraExpert":
        """An expert saved by `save` (local directory; never the hub). `name` overrides the saved one."""
        path = Path(path)
        meta_path = path / EXPERT_META_FILE
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise ExpertFileError(f"{path}: no {EXPERT_META_FILE}; is this a directory written by LoraExpert.save?") from None
        except json.JSONDecodeError as e:
            raise ExpertFileError(f"{meta_path}: not valid JSON ({e})") from None
        d_model = meta.get("d_model") if isinstance(meta, dict) else None
        if not isinstance(d_model, int) or d_model < 1:
            raise ExpertFileError(f"{meta_path}: d_model must be a positive integer, got {d_model!r}")
        if not (path / "adapter_config.json").is_file():
            raise ExpertFileError(f"{path}: no adapter_config.json (peft adapter files missing)")
        import peft  # here, not at the top: half a second of every node's start, for experts only
        model = peft.PeftModel.from_pretrained(_ZeroResidual(d_model), str(path), is_trainable=False)
        return cls(name or meta.get("name") or path.name, model, d_model)

    def __repr__(self) -> str:
        return f"LoraExpert(name={self.name!r}, d_model={self.d_model}, r={self.r}, scale={self.scale:g})"


class ExpertRegistry:
    """The experts a node hosts, by name. `get(None)` and `get("")` mean "no expert"."""

    def __init__(self, experts: Iterable[LoraExpert] = ()):
        self._lock = threading.Lock()
        self._experts: dict[str, LoraExpert] = {}
        for expert in experts:
            self.add(expert)

    def add(self, expert: LoraExpert) -> None:
        with self._lock:
            self._experts[expert.name] = expert

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._experts.pop(name, None) is not None

    def get(self, name: Optional[str]) -> Optional[LoraExpert]:
        if name is None or name == "":
            return None
        if not isinstance(name, str):
            raise UnknownExpertError(f"expert_name must be a string or null, got {type(name).__name__}")
        with self._lock:
            expert = self._experts.get(name)
            hosted = sorted(self._experts)
        if expert is None:
            raise UnknownExpertError(f"this node hosts no expert {name!r}; hosted experts: {hosted}")
        return expert

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._experts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._experts)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._experts

    @classmethod
    def load_dir(cls, root: Path | str) -> "ExpertRegistry":
        """Every expert saved under `root/<name>/` (subdirectories without `expert.json` are skipped)."""
        registry = cls()
        for sub in sorted(Path(root).iterdir()):
            if sub.is_dir() and (sub / EXPERT_META_FILE).is_file():
                registry.add(LoraExpert.load(sub))
                logger.info("loaded expert %r from %s", registry.names()[-1], sub)
        return registry


def _windows(token_ids: Sequence[int] | np.ndarray | torch.Tensor, seq_len: int) -> torch.Tensor:
    """Token ids as a [N, T] batch: a 2-D input as is, a 1-D one cut into windows of at most `seq_len`."""
    ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long)
    if ids.ndim == 2:
        if ids.shape[1] > seq_len:
            raise ValueError(f"sequences of {ids.shape[1]} tokens exceed the model's {seq_len} positions")
        return ids
    if ids.ndim != 1 or ids.numel() < 2:
        raise ValueError("token_ids must be a 1-D sequence of at least 2 tokens or a [N, T] batch")
    n = ids.numel() // seq_len
    if n == 0:
        return ids.unsqueeze(0)
    # drop a short tail rather than pad: padding would need an attention mask and teaches nothing
    return ids[: n * seq_len].view(n, seq_len)


def train_expert(
    model: GPT2LMHeadModel,
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    name: str,
    expert: Optional[LoraExpert] = None,
    r: int = 8,
    alpha: float = 16.0,
    steps: int = 50,
    lr: float = 1e-2,
    seed: int = 0,
) -> tuple[LoraExpert, list[float]]:
    """Train only the expert's LoRA parameters on top of the frozen `model`; returns (expert, loss per step).

    The path matches split inference: final hidden state (after ln_f) -> + expert delta -> tied LM
    head -> next-token cross-entropy. The frozen part is run once; each step only touches the expert.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    d_model = model.config.n_embd
    if expert is None:
        expert = LoraExpert.create(name, d_model, r=r, alpha=alpha, seed=seed)
    elif expert.d_model != d_model:
        raise ValueError(f"expert {expert.name!r} has hidden size {expert.d_model}, model has {d_model}")
    batch = _windows(token_ids, model.config.n_positions)  # (N, T)
    with torch.no_grad():
        hidden = model.transformer(input_ids=batch).last_hidden_state  # (N, T, d), after ln_f
    targets = batch[:, 1:].reshape(-1)  # (N*(T-1),)
    lm_head = model.get_output_embeddings()
    params = expert.parameters()
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    expert.module.train()
    losses: list[float] = []
    try:
        for step in range(steps):
            h = hidden + expert.delta(hidden)  # (N, T, d)
            logits = torch.nn.functional.linear(h[:, :-1], lm_head.weight.detach())  # (N, T-1, V)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            logger.debug("expert %r step %d loss %.4f", expert.name, step, losses[-1])
    finally:
        expert.module.eval()
    logger.info("trained expert %r for %d steps: loss %.4f -> %.4f", expert.name, steps, losses[0], losses[-1])
    return expert, losses
