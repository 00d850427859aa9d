"""Train a LoRA expert for split inference on a text file and save it for `dtrain-node --expert NAME=DIR`.

    python examples/train_expert.py --text banking.txt --out experts/banking --name banking

The expert is trained on top of the shared model as built from a model config (its seeded initial
weights), or on a checkpoint's weights with --checkpoint-dir; only the LoRA matrices learn.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig  # noqa: E402
from dtrain.node.model import build_model  # noqa: E402
from dtrain.node.split.experts import LoraExpert, train_expert  # noqa: E402
from dtrain.node.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", required=True, help="UTF-8 text file to train on")
    p.add_argument("--out", required=True, help="directory to write the expert into")
    p.add_argument("--name", required=True, help="the expert's name (what clients send as expert_name)")
    p.add_argument("--model-config", default=str(DEFAULT_STATIC_DIR / "model_config.json"))
    p.add_argument("--checkpoint-dir", help="train on the weights of this node checkpoint instead")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale = alpha / r)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--max-tokens", type=int, default=8192,
                   help="use at most this many tokens of the text (each step computes logits over the whole vocabulary)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    model = build_model(ModelConfig.load(args.model_config))
    if args.checkpoint_dir:
        from dtrain.node import checkpoint

        restored = checkpoint.load(args.checkpoint_dir)
        if restored is None:
            sys.exit(f"no checkpoint in {args.checkpoint_dir}")
        model.load_state_dict(restored.model_state)
    model.requires_grad_(False)
    ids = load_tokenizer(DEFAULT_STATIC_DIR).encode(Path(args.text).read_text(encoding="utf-8")).ids[: args.max_tokens]
    expert, losses = train_expert(model, ids, name=args.name, r=args.rank, alpha=args.alpha, steps=args.steps,
                                  lr=args.lr, seed=args.seed)
    expert.save(args.out)
    LoraExpert.load(args.out)  # what the node will do: fail here, not at node start
    print(f"expert {args.name!r}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved to {args.out}")
    print(f"serve it with: dtrain-node --expert {args.name}={args.out}")


if __name__ == "__main__":
    main()
