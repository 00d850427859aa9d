"""Split inference for one node: the SplitEngine, the weights it serves and what clients need to know.

Two sources of weights:
- the shared model (default): the node's frozen model of its current published snapshot, whose parameters
  are the snapshot's own bytes (node.frozen), shared with the /v1 engine; the training model itself is never
  run for inference.
- `split_model`: a local transformers causal-LM directory (GPT-2, or Llama/Qwen-style with rotary
  positions), loaded with `local_files_only=True`, frozen; its step is always 0.

The service never imports the bridge; the bridge turns its typed errors into answers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from transformers import PreTrainedModel

from dtrain.node.split.config import SplitConfig
from dtrain.node.split.engine import ForwardResult, SplitEngine
from dtrain.node.split.experts import ExpertRegistry, LoraExpert
from dtrain.node.split.he import HEContext
from dtrain.node.split.kv_cache import KVCacheStore
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

HE_POLY_MODULUS_DEGREE = 8192  # 4096 slots: a 4096-wide hidden state still fits one block


@dataclass(frozen=True)
class ModelFacts:
    """What a split client needs about the model it talks to (the `config` message)."""

    name: str  # informational model name
    hidden_size: int  # d: width of hidden_states and pre_activations
    vocab_size: int  # rows of the embedding matrix
    max_seq_len: int  # positions one session may hold
    embedding_tensor_id: Optional[int]  # manifest id of wte for the shared model; None for a split_model
    tied_lm_head: bool  # logits are pre_activations @ embedding^T
    eos_token_id: Optional[int] = None  # end-of-text token, for clients that stop on it


class SplitService:
    """The engine plus its weight source; thread-safe (the bridge calls `forward` from worker threads)."""

    def __init__(self, engine: SplitEngine, facts: ModelFacts, config: SplitConfig, experts: ExpertRegistry,
                 he: Optional[HEContext], embedding: Optional[torch.Tensor] = None,
                 lm_head: Optional[torch.Tensor] = None, tokenizer: Any = None):
        self.engine = engine
        self.experts = experts
        self.facts = facts
        self.config = config
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer (or transformers tokenizer) for `tokenize`
        # a split_model's embedding / LM head as served by /api/v1/split/embedding and /lm_head (frozen)
        self._embedding = embedding
        self._lm_head = lm_head
        self.he_available = he is not None

    # ---- facts for the protocol

    @property
    def step(self) -> int:
        return self.engine.weights_step

    @property
    def frame_limit_bytes(self) -> int:
        return self.config.frame_limit(self.facts.max_seq_len, self.facts.hidden_size)

    def expert_names(self) -> list[str]:
        return self.experts.names()

    def local_matrix(self, which: str) -> Optional[torch.Tensor]:
        """The split_model's `embedding` or `lm_head` [V, d] float32 (None for the shared model)."""
        return self._embedding if which == "embedding" else self._lm_head

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeError("this node has no tokenizer")
        encoded = self.tokenizer.encode(text)
        return list(encoded.ids) if hasattr(encoded, "ids") else list(encoded)

    # ---- serving

    def forward(self, hidden: np.ndarray, session_id: Optional[str] = None, incremental: bool = False,
                expert_name: Optional[str] = None, use_he: bool = False) -> ForwardResult:
        # use_he with an expert on a --no-he node is refused (HEUnavailableError), never silently downgraded
        return self.engine.forward(hidden, session_id=session_id, incremental=incremental,
                                   expert_name=expert_name, use_he=use_he)


# ---- building ------------------------------------------------------------------------------------------


def _experts(config: SplitConfig, hidden_size: int) -> ExpertRegistry:
    registry = ExpertRegistry()
    for name, path in config.experts:
        expert = LoraExpert.load(path, name=name)
        if expert.d_model != hidden_size:
            raise ValueError(f"expert {name!r} ({path}) has hidden size {expert.d_model}; the model has {hidden_size}")
        registry.add(expert)
        logger.info("hosting split expert %r from %s (r=%d)", name, path, expert.r)
    return registry


def _he(config: SplitConfig, experts: ExpertRegistry) -> Optional[HEContext]:
    # without an expert there is nothing to encrypt: skip the key generation
    if not config.he or len(experts) == 0:
        return None
    return HEContext(poly_modulus_degree=HE_POLY_MODULUS_DEGREE)


def _kv(config: SplitConfig) -> KVCacheStore:
    return KVCacheStore(max_sessions=config.max_sessions, ttl_s=config.session_ttl_s)


def for_node(node, config: SplitConfig, tokenizer: Any = None, models=None) -> SplitService:
    """The split service of a started TrainingNode (its shared model, or `config.split_model`). `models`: the node's
    node.frozen.SnapshotModels, shared with the /v1 engine (one of its own when None)."""
    if config.split_model:
        return from_pretrained(config.split_model, config, tokenizer, device=node.device.torch_device)
    from dtrain.node.frozen import SnapshotModels
    from dtrain.node.model import embedding_tensor_id, meta_template

    model_config = node.model_config
    model = meta_template(model_config)  # shapes only: the engine reads the snapshot's bytes (node.frozen)
    if models is None:
        models = SnapshotModels.following(node, model)
    experts = _experts(config, model.config.hidden_size)
    he = _he(config, experts)
    engine = SplitEngine(model, lambda: node.step, _kv(config), config.dp, experts, he=he,
                         device=node.device.torch_device, source=models)
    facts = ModelFacts(
        name=model_config.name,
        hidden_size=model.config.hidden_size,
        vocab_size=model.config.vocab_size,
        max_seq_len=engine.max_seq_len,
        embedding_tensor_id=embedding_tensor_id(model),
        tied_lm_head=True,
        eos_token_id=model.config.eos_token_id,
    )
    logger.info("split inference on the shared model %s (step %d, dp sigma %.4f, experts %s, HE %s)",
                facts.name, engine.weights_step, config.dp.sigma, experts.names(), he is not None)
    return SplitService(engine, facts, config, experts, he, tokenizer=tokenizer)


def from_pretrained(path: str | Path, config: SplitConfig, fallback_tokenizer: Any = None,
                    device: torch.device = torch.device("cpu")) -> SplitService:
    """Serve a local transformers causal LM directory, frozen (step 0), its blocks on `device`."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"--split-model {path}: not a directory (a local transformers model is required)")
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    model.eval()
    model.requires_grad_(False)
    hf = model.config
    embedding = model.get_input_embeddings().weight.detach().to(torch.float32)
    head = model.get_output_embeddings()
    lm_head = head.weight.detach().to(torch.float32) if head is not None else embedding
    tied = lm_head.data_ptr() == embedding.data_ptr() or torch.equal(lm_head, embedding)
    experts = _experts(config, hf.hidden_size)
    he = _he(config, experts)
    engine = SplitEngine(model, lambda: 0, _kv(config), config.dp, experts, he=he, device=device)
    tokenizer = fallback_tokenizer
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    else:
        logger.warning("%s has no tokenizer.json; `tokenize` uses the node's GPT-2 tokenizer", path)
    facts = ModelFacts(
        name=getattr(hf, "name_or_path", None) or path.name,
        hidden_size=hf.hidden_size,
        vocab_size=embedding.shape[0],
        max_seq_len=engine.max_seq_len,
        embedding_tensor_id=None,
        tied_lm_head=bool(tied),
        eos_token_id=hf.eos_token_id if isinstance(hf.eos_token_id, int) else None,
    )
    logger.info("split inference on %s (%s, frozen)", path, type(model).__name__)
    return SplitService(engine, facts, config, experts, he, embedding=embedding, lm_head=None if tied else lm_head,
                        tokenizer=tokenizer)
