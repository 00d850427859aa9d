"""One bare hivemind.Optimizer peer (the baseline of bench/bench_swarm.py): the same tiny GPT-2, AdamW, batch,
target and timeouts as a dtrain node training on local data, and nothing else. Prints `epoch N T` per update."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import hivemind
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dtrain.node.config import ModelConfig, TrainConfig  # noqa: E402
from dtrain.node.model import build_model  # noqa: E402
from dtrain.node.train.adamw import make_local_optimizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--run-id", required=True)
    p.add_argument("--model-config", required=True)
    p.add_argument("--target-batch-size", type=int, default=24)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--matchmaking-time", type=float, default=2.5)
    p.add_argument("--averaging-timeout", type=float, default=8.0)
    p.add_argument("--request-timeout", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=8)
    args = p.parse_args()
    model_config = ModelConfig.load(args.model_config)
    model = build_model(model_config)
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    print("MADDR", dht.get_visible_maddrs()[0], flush=True)
    opt = hivemind.Optimizer(
        dht=dht, run_id=args.run_id, target_batch_size=args.target_batch_size,
        optimizer=make_local_optimizer(model, TrainConfig()), matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout, delay_state_averaging=False, average_state_every=1,
        average_opt_statistics=("exp_avg", "exp_avg_sq"), averager_opts=dict(request_timeout=args.request_timeout),
        tracker_opts=dict(min_refresh_period=0.2, max_refresh_period=1.0, default_refresh_period=0.5),
    )
    if args.initial_peers:
        opt.load_state_from_peers()
    rng = np.random.default_rng(0)
    while opt.local_epoch < args.epochs:
        epoch = opt.local_epoch
        if opt.grad_averager.local_samples_accumulated < args.batch:  # one batch per update, like the node's cap
            tokens = torch.from_numpy(rng.integers(0, model_config.vocab_size, (args.batch, args.seq_len)))
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step(batch_size=args.batch)
            opt.zero_grad()
        else:
            opt.step(batch_size=0)
            time.sleep(0.25)
        if opt.local_epoch != epoch:
            print("epoch", opt.local_epoch, time.time(), flush=True)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
