"""Hugging Face model directories in and out: a GPT-2-family checkpoint a swarm can start from (`--init-from`), and
the directory `dtrain-export` writes, which `transformers.AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load with no extra code.

Reading takes weights only: `model.safetensors`, or `pytorch_model.bin` through torch's weights-only unpickler.
Only what dtrain's model is can be imported (GPT-2 blocks, GELU-new, tied LM head, no dropout at training); any
other setting is refused with the field that differs, before a weight is read.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch

from dtrain.node.assets import TokenizerFiles
from dtrain.node.config import ModelConfig

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
PYTORCH_NAME = "pytorch_model.bin"
TOKENIZER_FILES = ("vocab.json", "merges.txt")
# transformers' GPT2Config defaults for what dtrain's model fixes: anything else is a different model
_FIXED = {"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
          "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "tie_word_embeddings": True}
_IGNORED_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks older checkpoints saved as buffers


class HFImportError(ValueError):
    """A directory that is not a GPT-2-family checkpoint dtrain's model can hold; the message says why."""


@dataclass(frozen=True)
class Imported:
    """A checkpoint read from disk: dtrain's model config and the parameters by dtrain's names, float32."""

    config: ModelConfig
    params: dict[str, torch.Tensor]
    tokenizer_dir: Optional[Path]  # the directory when it has vocab.json and merges.txt


def read_config(directory: str | Path) -> ModelConfig:
    """dtrain's ModelConfig of a Hugging Face GPT-2 directory's config.json; HFImportError when it is another model."""
    directory = Path(directory)
    path = directory / CONFIG_NAME
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFImportError(f"{directory}: no {CONFIG_NAME}; --init-from takes a Hugging Face model directory") from None
    except json.JSONDecodeError as e:
        raise HFImportError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise HFImportError(f"{path}: expected a JSON object")
    if hf.get("model_type") != "gpt2":
        raise HFImportError(f"{path}: model_type {hf.get('model_type')!r}; only GPT-2-family (gpt2) models can be "
                            "imported")
    for key, expected in _FIXED.items():
        value = hf.get(key, expected)
        if value != expected:
            raise HFImportError(f"{path}: {key} is {value!r}; dtrain's GPT-2 needs {expected!r}")
    d_model = hf.get("n_embd", 768)
    inner = hf.get("n_inner")
    try:
        return ModelConfig(vocab_size=hf.get("vocab_size", 50257), d_model=d_model, n_heads=hf.get("n_head", 12),
                           n_layers=hf.get("n_layer", 12), d_ff=4 * d_model if inner is None else inner,
                           max_seq_len=hf.get("n_positions", 1024), name=_name(hf, directory))
    except (ValueError, TypeError) as e:
        raise HFImportError(f"{path}: {e}") from None


def _name(hf: dict, directory: Path) -> str:
    name = hf.get("_name_or_path") or directory.resolve().name
    return str(name).rstrip("/").rsplit("/", 1)[-1] or "gpt2"


def read_weights(directory: str | Path, names: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The parameters `names` (dtrain's name -> shape) from the directory's weights file, as float32.

    Keys may carry GPT2LMHeadModel's `transformer.` prefix or not (GPT2Model, as the original GPT-2 was saved); a
    saved `lm_head.weight` must equal the token embedding it is tied to."""
    directory = Path(directory)
    if (directory / SAFETENSORS_NAME).is_file():
        from safetensors.torch import load_file

        raw = load_file(directory / SAFETENSORS_NAME, device="cpu")
    elif (directory / PYTORCH_NAME).is_file():
        raw = torch.load(directory / PYTORCH_NAME, map_location="cpu", weights_only=True)
    else:
        raise HFImportError(f"{directory}: neither {SAFETENSORS_NAME} nor {PYTORCH_NAME} (sharded checkpoints are not "
                            "supported)")
    found: dict[str, torch.Tensor] = {}
    head = None
    for key, tensor in raw.items():
        if key.endswith(_IGNORED_BUFFERS):
            continue
        if key == "lm_head.weight":
            head = tensor
            continue
        name = key if key.startswith("transformer.") else "transformer." + key
        if name not in names:
            raise HFImportError(f"{directory}: unexpected tensor {key!r}; not a GPT-2 of this shape")
        found[name] = tensor
    missing = sorted(set(names) - set(found))
    if missing:
        raise HFImportError(f"{directory}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    out = {}
    for name, shape in names.items():
        tensor = found[name]
        if tuple(tensor.shape) != tuple(shape):
            raise HFImportError(f"{directory}: {name} has shape {tuple(tensor.shape)}, config.json says {tuple(shape)}")
        if not tensor.is_floating_point():
            raise HFImportError(f"{directory}: {name} is {tensor.dtype}, not floating point")
        out[name] = tensor.to(torch.float32).contiguous()
        if not torch.isfinite(out[name]).all():
            raise HFImportError(f"{directory}: {name} holds NaN or infinite values")
    if head is not None and not torch.equal(head.to(torch.float32), out["transformer.wte.weight"]):
        raise HFImportError(f"{directory}: lm_head.weight differs from the token embedding; dtrain's LM head is tied")
    return out


def read(directory: str | Path) -> Imported:
    """A GPT-2-family Hugging Face directory, checked and read (config, then weights)."""
    from dtrain.node.model import meta_template

    directory = Path(directory)
    config = read_config(directory)
    shapes = {name: tuple(p.shape) for name, p in meta_template(config).named_parameters()}
    params = read_weights(directory, shapes)
    has_tokenizer = all((directory / f).is_file() for f in TOKENIZER_FILES)
    return Imported(config=config, params=params, tokenizer_dir=directory if has_tokenizer else None)


def load_params(model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy `params` (name -> tensor, exactly the model's named_parameters) into `model`, byte for byte."""
    own = dict(model.named_parameters())
    if set(own) != set(params):
        extra, missing = sorted(set(params) - set(own)), sorted(set(own) - set(params))
        raise ValueError(f"parameters do not match the model: unexpected {extra[:4]}, missing {missing[:4]}")
    with torch.no_grad():
        for name, p in own.items():
            if tuple(params[name].shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(params[name].shape)}, the model's is {tuple(p.shape)}")
            p.copy_(params[name])


def write(out: str | Path, config: ModelConfig, params: Mapping[str, torch.Tensor], tokenizer: TokenizerFiles,
          card: str) -> Path:
    """A directory transformers loads as is: model.safetensors and config.json (save_pretrained's layout), the
    tokenizer (tokenizer.json and GPT-2's vocab.json / merges.txt) and a README.md card. Written beside `out` and
    renamed into place, so `out` is whole or absent."""
    from transformers import GPT2TokenizerFast

    from dtrain.node.model import materialize, meta_template

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new directory")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = materialize(meta_template(config))  # every parameter is overwritten: no seeded init to throw away
        load_params(model, params)
        model.save_pretrained(tmp, safe_serialization=True)
        vocab = json.loads(tokenizer.vocab.read_text(encoding="utf-8"))
        lines = tokenizer.merges.read_text(encoding="utf-8").splitlines()
        merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
        GPT2TokenizerFast(vocab=vocab, merges=merges, model_max_length=config.max_seq_len).save_pretrained(tmp)
        for name, path in tokenizer.by_name.items():  # the plain files too, for tools that read GPT-2's pair
            shutil.copyfile(path, tmp / name)
        (tmp / "README.md").write_text(card)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
