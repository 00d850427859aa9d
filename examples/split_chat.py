"""Chat with a dtrain node through split inference: embeddings, LM head and sampling stay on this machine.

    python examples/split_chat.py --node http://127.0.0.1:8095                      # interactive
    python examples/split_chat.py --node http://127.0.0.1:8095 --prompt "Once upon" # one shot
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dtrain.clients.split_client import SplitClient  # noqa: E402
from dtrain.node.tokenizer import load_tokenizer  # noqa: E402
from dtrain.node.config import DEFAULT_STATIC_DIR  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--node", default="http://127.0.0.1:8095", help="the node's bridge URL")
    p.add_argument("--prompt", help="answer this one prompt and exit (default: interactive)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--repetition-penalty", type=float, default=1.2)
    p.add_argument("--noise-sigma", type=float, default=0.0,
                   help="client-side Gaussian noise on each embedding (see docs/split-privacy.md)")
    p.add_argument("--expert", help="LoRA expert hosted by the node")
    p.add_argument("--he", action="store_true", help="ask the node to compute the expert under CKKS")
    p.add_argument("--transport", choices=("auto", "ws", "http"), default="auto")
    p.add_argument("--seed", type=int)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    # local decoding of the chosen tokens: the node never sees them
    tokenizer = load_tokenizer(DEFAULT_STATIC_DIR)
    with SplitClient(args.node, transport=args.transport, noise_sigma=args.noise_sigma,
                     expert_name=args.expert, use_he=args.he, seed=args.seed) as client:
        cfg = client.config
        print(f"# {cfg['model']} at step {cfg['step']} via {'WebSocket' if client.using_websocket else 'HTTP'}; "
              f"dp sigma {cfg['dp']['sigma']:.4f}; experts {cfg['experts']}", file=sys.stderr)
        eos = [cfg["eos_token_id"]] if cfg.get("eos_token_id") is not None else []

        def answer(prompt: str) -> None:
            ids = client.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, repetition_penalty=args.repetition_penalty, stop_token_ids=eos)
            print(tokenizer.decode(ids), flush=True)
            a = client.last_answer
            print(f"# {len(ids)} tokens; last call {a.get('total_ms', 0):.1f} ms, he_active {a.get('he_active')}",
                  file=sys.stderr)

        if args.prompt is not None:
            answer(args.prompt)
            return
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if line.strip():
                answer(line)


if __name__ == "__main__":
    main()
