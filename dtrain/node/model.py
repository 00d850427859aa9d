"""The shared GPT-2-style model: built from a ModelConfig with seeded weights, and its tensor listing."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dtrain.node.config import ModelConfig


def hf_config(config: ModelConfig) -> GPT2Config:
    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_seq_len,
        n_embd=config.d_model,
        n_layer=config.n_layers,
        n_head=config.n_heads,
        n_inner=config.d_ff,
        # no dropout: gradients computed by browsers and by the node must agree exactly
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=min(50256, config.vocab_size - 1),
        eos_token_id=min(50256, config.vocab_size - 1),
        tie_word_embeddings=True,
    )


def build_model(config: ModelConfig) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel with the config's seeded initial weights (identical on every machine)."""
    devices = []  # fork_rng must not touch CUDA state: the node is CPU-first
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(config.seed)
        model = GPT2LMHeadModel(hf_config(config))
    model.eval()  # dropout is 0 anyway; eval keeps transformers from warning about training mode
    return model


def meta_template(config: ModelConfig) -> GPT2LMHeadModel:
    """The model's shapes and tied-parameter layout on the `meta` device: no parameter memory. Engines that read a
    snapshot's weights keep this instead of a second full model, and materialize a copy to load a snapshot into."""
    with torch.device("meta"):
        model = GPT2LMHeadModel(hf_config(config))
    model.eval()
    return model


def materialize(template: torch.nn.Module) -> torch.nn.Module:
    """A CPU copy of `template` to load weights into: uninitialised when the template is on `meta`, with its tied
    parameters tied again (to_empty makes each a parameter of its own)."""
    model = copy.deepcopy(template)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu")
        model.tie_weights()
    return model


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the API manifest: a parameter in `named_parameters()` order, tied weights once."""

    id: int
    name: str
    shape: tuple[int, ...]
    elements: int


def tensor_infos(model: torch.nn.Module) -> tuple[TensorInfo, ...]:
    # named_parameters() already lists a tied weight (wte / lm_head) once
    return tuple(
        TensorInfo(id=i, name=name, shape=tuple(p.shape), elements=p.numel())
        for i, (name, p) in enumerate(model.named_parameters())
    )


def embedding_tensor_id(model: torch.nn.Module) -> int:
    """The manifest id of the token embedding (tied with the LM head): what split clients download."""
    for info in tensor_infos(model):
        if info.name.endswith("wte.weight"):
            return info.id
    raise LookupError("model has no token embedding (wte.weight)")
