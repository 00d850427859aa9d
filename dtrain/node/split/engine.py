"""The node side of split inference: client embeddings in, pre-activations out.

The client sends token embeddings `wte[token_id]` [T, d]. The engine adds the position information
(learned position embeddings for GPT-2, rotary positions for Llama/Qwen-style models) at the positions
the session's KV cache says come next, runs every block and the final layer norm, optionally clips and noises the result (DP), adds the LoRA expert's delta (under CKKS
when asked), and returns `pre_activations` [T, d]; the client's logits are `pre_activations @ wte^T`.

The engine runs a model the training thread never changes under a running forward: the node's shared frozen
model of its current snapshot (`source`, node.frozen), taken per call, or a private copy that `load_weights` swaps
for a new one (a fixed model). Sessions cached under older weights are refused (StaleSessionError) instead of
being continued with different parameters.
"""
from __future__ import annotations

import contextlib
import copy
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from dtrain.node.split.dp import DPConfig
from dtrain.node.split.experts import ExpertRegistry, UnknownExpertError
from dtrain.node.split.he import HEContext, HEError, he_lora_delta
from dtrain.node.split.kv_cache import KVCacheStore, SessionCache, SessionIdError, SplitError, check_session_id
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

__all__ = [
    "ForwardResult",
    "HEError",
    "HEUnavailableError",
    "HiddenStateError",
    "NoSessionError",
    "SequenceTooLongError",
    "SessionIdError",
    "SplitEngine",
    "SplitError",
    "StaleSessionError",
    "UnknownExpertError",
]


class HiddenStateError(SplitError):
    """`hidden_states` has the wrong shape, dtype or non-finite values."""


class SequenceTooLongError(SplitError):
    """The session would run past the model's last position."""


class NoSessionError(SplitError):
    """An incremental call names a session the node has no cache for (never started, evicted or expired)."""


class StaleSessionError(SplitError):
    """The model has moved since the session's cache was built; the client must resend its whole sequence."""


class HEUnavailableError(SplitError):
    """`use_he` was asked of a node that runs without an HE context."""


@dataclass(frozen=True)
class ForwardResult:
    pre_activations: np.ndarray  # float32 [T, d]: final hidden state (+ DP noise, + expert delta)
    he_active: bool  # the expert delta was computed under CKKS
    encrypt_ms: float  # CKKS encode + encrypt (0 without HE)
    compute_ms: float  # encrypted multiply + rotations + plaintext B product (0 without HE)
    decrypt_ms: float  # CKKS decrypt + decode (0 without HE)
    total_ms: float  # the whole call, validation to result
    dp_sigma: float  # noise standard deviation applied (0 when DP is off)
    incremental: bool  # the call continued a cached session
    cached_seq_len: int  # positions already in the session's cache before this call
    step: int = 0  # model step of the weights that computed this answer


@dataclass(frozen=True)
class _Weights:
    model: PreTrainedModel  # never mutated once published
    step: int  # model step these parameters belong to


class SplitEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        step_fn: Callable[[], int],
        kv: KVCacheStore,
        dp: DPConfig,
        experts: ExpertRegistry,
        he: Optional[HEContext] = None,
        max_seq_len: Optional[int] = None,
        device: torch.device = torch.device("cpu"),
        source=None,
    ):
        # GPT2Config maps these generic names onto n_positions / n_embd; Llama/Qwen configs use them directly
        n_positions = model.config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = n_positions
        if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= n_positions:
            raise ValueError(f"max_seq_len must be an integer in [1, {n_positions}] (the model's positions), got {max_seq_len!r}")
        self._step_fn = step_fn
        self._kv = kv
        self._dp = dp
        self._experts = experts
        self._he = he
        self.max_seq_len = max_seq_len
        self.hidden_dim = model.config.hidden_size
        self.device = torch.device(device)  # the blocks and KV caches; DP noise, experts and HE stay on the CPU
        self._weights_lock = threading.Lock()  # guards _weights (the reference swap) and serializes loads
        # `source`: the node's shared models (node.frozen.SnapshotModels), `model` is then its `meta` template and
        # the engine holds no model between calls; without it, a private copy of `model`
        self._source = source
        self._weights = None if source is not None else _Weights(self._private_copy(model), int(step_fn()))

    # ---- weights

    def _private_copy(self, model: PreTrainedModel) -> PreTrainedModel:
        own = copy.deepcopy(model).to(self.device)
        own.eval()
        own.requires_grad_(False)
        return own

    @property
    def weights_step(self) -> int:
        return self._source.step() if self._source is not None else self._weights.step

    def _current(self) -> _Weights:
        if self._source is None:
            return self._weights
        current = self._source.current(self.device)
        return _Weights(current.model, current.step)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], step: int) -> None:
        """Publish new parameters for model step `step` (the node calls this when its step changes).

        A fresh copy is filled and then swapped in, so forwards already running finish on the
        weights they started with.
        """
        if self._source is not None:
            raise RuntimeError("this engine reads the node's shared models: it loads no weights of its own")
        with self._weights_lock:
            fresh = copy.deepcopy(self._weights.model)
            fresh.load_state_dict(state_dict, strict=True)  # copies (onto the device): the caller may keep training
            fresh.eval()
            fresh.requires_grad_(False)
            self._weights = _Weights(fresh, int(step))
        logger.info("split engine now serves model step %d", step)

    # ---- serving

    def session_count(self) -> int:
        """KV-cached sessions alive now (what /metrics reports)."""
        return len(self._kv)

    @property
    def dp_sigma(self) -> float:
        return self._dp.sigma

    def forward(
        self,
        hidden: np.ndarray,
        session_id: Optional[str] = None,
        incremental: bool = False,
        expert_name: Optional[str] = None,
        use_he: bool = False,
        seed: Optional[int] = None,
    ) -> ForwardResult:
        """Run the server half on `hidden` [T, d] float32 token embeddings; see the module docstring."""
        t_start = time.perf_counter()
        hidden = self._check_hidden(hidden)
        T = hidden.shape[0]
        expert = self._experts.get(expert_name)  # UnknownExpertError before any work
        if use_he and expert is not None and self._he is None:
            raise HEUnavailableError("this node runs without homomorphic encryption; send use_he=false")
        if incremental and session_id is None:
            raise NoSessionError("incremental=true needs the session_id of an earlier non-incremental call")
        if session_id is not None:
            check_session_id(session_id)

        weights = self._current()  # one snapshot for the whole call
        lock = self._kv.session(session_id) if session_id is not None else contextlib.nullcontext()
        with lock:
            cache, past_len = self._session_cache(session_id, incremental, weights)
            if past_len + T > self.max_seq_len:
                raise SequenceTooLongError(
                    f"{past_len} cached + {T} new positions exceed the node's {self.max_seq_len}; "
                    "start a new session with a shorter sequence"
                )
            try:
                final = self._run_blocks(weights.model, hidden, cache, past_len)  # (T, d)
            except Exception:
                if session_id is not None:
                    self._kv.drop(session_id)  # the cache may hold a partial update
                raise
            if session_id is not None:
                self._kv.put(session_id, SessionCache(cache, weights.step, past_len + T))

        final = self._dp.apply(final, _generator(seed))
        encrypt_ms = compute_ms = decrypt_ms = 0.0
        he_active = False
        if expert is not None:
            if use_he:
                delta_np, timings = he_lora_delta(self._he, final.numpy(), expert.A, expert.B, expert.scale)
                final = final + torch.from_numpy(delta_np)
                encrypt_ms, compute_ms, decrypt_ms = timings["encrypt_ms"], timings["compute_ms"], timings["decrypt_ms"]
                he_active = True
            else:
                with torch.no_grad():
                    final = final + expert.delta(final)
        pre_activations = np.ascontiguousarray(final.detach().numpy(), dtype=np.float32)
        return ForwardResult(
            pre_activations=pre_activations,
            he_active=he_active,
            encrypt_ms=encrypt_ms,
            compute_ms=compute_ms,
            decrypt_ms=decrypt_ms,
            total_ms=(time.perf_counter() - t_start) * 1e3,
            dp_sigma=self._dp.sigma,
            incremental=bool(incremental),
            cached_seq_len=past_len,
            step=weights.step,
        )

    def _check_hidden(self, hidden: object) -> np.ndarray:
        if not isinstance(hidden, np.ndarray):
            raise HiddenStateError(f"hidden_states must be a numpy array, got {type(hidden).__name__}")
        if hidden.dtype != np.float32:
            raise HiddenStateError(f"hidden_states must be float32, got {hidden.dtype}")
        if hidden.ndim != 2:
            raise HiddenStateError(f"hidden_states must be [seq_len, hidden_dim], got shape {hidden.shape}")
        T, d = hidden.shape
        if d != self.hidden_dim:
            raise HiddenStateError(f"hidden_dim {d} does not match the model's {self.hidden_dim}")
        if T < 1:
            raise HiddenStateError("seq_len must be >= 1")
        if not np.isfinite(hidden).all():
            raise HiddenStateError("hidden_states contains NaN or infinity")
        return hidden

    def _session_cache(
        self, session_id: Optional[str], incremental: bool, weights: _Weights
    ) -> tuple[Optional[DynamicCache], int]:
        """(cache to extend, positions already in it); the caller holds the session's lock."""
        if session_id is None:
            return None, 0
        if not incremental:
            self._kv.drop(session_id)  # a non-incremental call (re)starts the session
            return DynamicCache(), 0
        entry = self._kv.get(session_id)
        if entry is None:
            raise NoSessionError(
                f"no cached session {session_id!r} (never started, evicted or expired); "
                "resend the whole sequence with incremental=false"
            )
        current = int(self._step_fn())
        if entry.step != current or entry.step != weights.step:
            self._kv.drop(session_id)
            raise StaleSessionError(
                f"session {session_id!r} was built at model step {entry.step} and the model is now at step "
                f"{current}; resend the whole sequence with incremental=false"
            )
        return entry.cache, entry.seq_len

    @staticmethod
    def _run_blocks(
        model: PreTrainedModel, hidden: np.ndarray, cache: Optional[DynamicCache], past_len: int
    ) -> torch.Tensor:
        T = hidden.shape[0]
        # (1, T, d) in the model's dtype; GPT2Model adds wpe[position_ids], Llama-style models rotate q/k by them
        device = model.device
        embeds = torch.from_numpy(hidden).to(device, model.dtype).unsqueeze(0)
        position_ids = torch.arange(past_len, past_len + T, dtype=torch.long, device=device).unsqueeze(0)  # (1, T)
        with torch.no_grad():
            # base_model: GPT2LMHeadModel.transformer, LlamaForCausalLM.model (the blocks + final norm, no LM head)
            out = model.base_model(
                inputs_embeds=embeds,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=cache is not None,
            )
        return out.last_hidden_state[0].to("cpu", torch.float32)  # (T, d), after the final norm


def _generator(seed: Optional[int]) -> torch.Generator:
    # without a seed the noise must not be predictable from anything the client can see
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else int(seed))
