"""`dtrain-export`: the swarm's model as a Hugging Face directory that every tool reads.

    dtrain-export --node http://localhost:8095 --out my-model     # through the Training API, one consistent step
    dtrain-export --checkpoint ckpt/ --out my-model               # a node's --checkpoint-dir

Either writes model.safetensors, config.json, the tokenizer and a README.md card naming the step and the sha256 of
the parameters (the `params_sha256` a node reports for that step), so that
`transformers.AutoModelForCausalLM.from_pretrained("my-model")` and `AutoTokenizer.from_pretrained("my-model")` load
it with no dtrain code. From a node, every tensor is downloaded as float32; a download that spans an update (the
step moved, or the digest is not the node's) starts over, at most MAX_TRIES times.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from dtrain.node import checkpoint as ckpt
from dtrain.node import hfdir
from dtrain.node.assets import tokenizer_files
from dtrain.node.config import ModelConfig
from dtrain.node.model import meta_template
from dtrain.node.snapshot import digest

MAX_TRIES = 5  # downloads that spanned an update before giving up
TIMEOUT_S = 60.0  # bound on one HTTP request
MAX_TOKENIZER_BYTES = 16 << 20  # vocab.json / merges.txt larger than this are not a tokenizer


class ExportError(RuntimeError):
    """The model could not be exported; the message says why."""


@dataclass(frozen=True)
class Exported:
    config: ModelConfig
    params: dict[str, torch.Tensor]
    step: int
    sha256: str
    source: str


def _get(url: str, limit: Optional[int] = None) -> tuple[bytes, dict]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
            body = r.read(limit + 1 if limit is not None else -1)
            if limit is not None and len(body) > limit:
                raise ExportError(f"{url}: more than {limit} bytes")
            return body, dict(r.headers)
    except urllib.error.HTTPError as e:
        raise ExportError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ExportError(f"{url}: {e}") from None


def _get_json(url: str) -> dict:
    body, _ = _get(url, 64 << 20)
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        raise ExportError(f"{url}: not JSON ({e})") from None


def from_node(url: str) -> tuple[Exported, dict[str, bytes]]:
    """The parameters of one step of the node at `url`, checked against its digest, and its tokenizer files."""
    url = url.rstrip("/")
    raw = _get_json(f"{url}/static/model_config.json")
    try:
        config = ModelConfig(**raw)
    except (TypeError, ValueError) as e:
        raise ExportError(f"{url}/static/model_config.json: {e}") from None
    shapes = {name: tuple(p.shape) for name, p in meta_template(config).named_parameters()}
    tokenizer = {name: _get(f"{url}/static/{name}", MAX_TOKENIZER_BYTES)[0] for name in hfdir.TOKENIZER_FILES}
    for _ in range(MAX_TRIES):
        manifest = _get_json(f"{url}/api/v1/model/manifest")
        tensors = manifest["tensors"]
        if [(t["name"], tuple(t["shape"])) for t in tensors] != list(shapes.items()):
            raise ExportError(f"{url}: the manifest's tensors are not those of its model config")
        arrays, steps = [], {int(manifest["step"])}
        for t in tensors:
            body, headers = _get(f"{url}/api/v1/model/tensor/{t['id']}?format=f32", 4 * t["elements"])
            if len(body) != 4 * t["elements"]:
                raise ExportError(f"tensor {t['id']}: {len(body)} bytes, expected {4 * t['elements']}")
            steps.add(int(headers.get("X-Model-Step", -1)))
            arrays.append(np.frombuffer(body, "<f4"))
        status = _get_json(f"{url}/api/v1/swarm/status")
        steps.add(int(status["step"]))
        if len(steps) != 1:
            continue  # an update landed during the download
        sha = digest(arrays)
        if sha != status["params_sha256"]:
            raise ExportError(f"{url}: the downloaded step {status['step']} has sha256 {sha}, the node reports "
                              f"{status['params_sha256']}")
        if not all(np.isfinite(a).all() for a in arrays):
            raise ExportError(f"{url}: the parameters hold NaN or infinite values")
        params = {name: torch.from_numpy(a.copy()).view(shape) for (name, shape), a in zip(shapes.items(), arrays)}
        return Exported(config, params, steps.pop(), sha, url), tokenizer
    raise ExportError(f"{url}: the model moved during each of {MAX_TRIES} downloads; try again when it updates "
                      "less often")


def from_checkpoint(directory: str | Path) -> Exported:
    restored = ckpt.load(directory)
    if restored is None:
        raise ExportError(f"{directory}: no {ckpt.CHECKPOINT_NAME}")
    if restored.model_config is None:
        raise ExportError(f"{directory}: the checkpoint does not say its model config")
    names = [name for name, _ in meta_template(restored.model_config).named_parameters()]  # the manifest's order
    if set(names) != set(restored.params):
        raise ExportError(f"{directory}: the checkpoint's tensors are not those of its model config")
    params = {name: restored.params[name].to(torch.float32) for name in names}
    sha = digest(t.reshape(-1).numpy() for t in params.values())
    return Exported(restored.model_config, params, restored.epoch + 1, sha, str(directory))


def card(exported: Exported) -> str:
    c = exported.config
    n = sum(t.numel() for t in exported.params.values())
    return (f"# {c.name}\n\nA GPT-2-style causal language model trained by a dtrain swarm, exported at step "
            f"{exported.step} ({exported.step - 1} updates) from {exported.source}.\n\n"
            f"- parameters: {n:,} ({c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads, d_ff {c.d_ff}, "
            f"context {c.max_seq_len}, vocabulary {c.vocab_size})\n"
            f"- sha256 of the float32 parameters in the node's manifest order: `{exported.sha256}` (the "
            f"`params_sha256` a node reports for step {exported.step})\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "model = AutoModelForCausalLM.from_pretrained(\"DIR\")\ntokenizer = AutoTokenizer.from_pretrained(\"DIR\")\n"
            "```\n")


def export(out: str | Path, node: Optional[str] = None, checkpoint: Optional[str] = None,
           tokenizer_dir: Optional[str] = None) -> Exported:
    if (node is None) == (checkpoint is None):
        raise ExportError("give one of --node URL and --checkpoint DIR")
    if node is not None:
        exported, files = from_node(node)
        with tempfile.TemporaryDirectory() as tmp:
            for name, body in files.items():
                (Path(tmp) / name).write_bytes(body)
            hfdir.write(out, exported.config, exported.params, tokenizer_files(tmp), card(exported))
        return exported
    exported = from_checkpoint(checkpoint)
    hfdir.write(out, exported.config, exported.params, tokenizer_files(tokenizer_dir), card(exported))
    return exported


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="dtrain-export", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--node", metavar="URL", help="a running node's bridge, e.g. http://localhost:8095")
    source.add_argument("--checkpoint", metavar="DIR", help="a node's --checkpoint-dir")
    p.add_argument("--out", metavar="DIR", required=True, help="the directory to write (new or empty)")
    p.add_argument("--tokenizer-dir", metavar="DIR", help="with --checkpoint: vocab.json and merges.txt to ship "
                                                          "(default GPT-2's)")
    args = p.parse_args(argv)
    try:
        exported = export(args.out, node=args.node, checkpoint=args.checkpoint, tokenizer_dir=args.tokenizer_dir)
    except (ExportError, ckpt.CheckpointError, hfdir.HFImportError, FileExistsError, OSError) as e:
        print(f"dtrain-export: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"Wrote {args.out}: {exported.config.name} at step {exported.step}, params sha256 {exported.sha256}")


if __name__ == "__main__":
    main()
