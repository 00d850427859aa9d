"""Training and serving on the CPU next to a CUDA GPU (`--device`), on the same machine: prints markdown tables.

Training: what a node does with one local batch (`--local-batch-size` sequences of `--local-seq-len` tokens): the
forward and backward pass through node.train.compute (on the GPU: the master's parameters copied in, bf16 autocast,
the gradient copied back as fp32), the gradient into the pending sum, then one AdamW step of the fp32 master on the
CPU (the inner update of a low-comm round). samples/s is batches x batch size over the wall time; the pass and the
AdamW columns split each batch's milliseconds (medians), and on the GPU "parameters in" is the part of the pass that
copies the master's parameters into the replica.

Serving: the /v1 engine (continuous batching on the KV cache) in-process, greedy, C streams each sending requests
back to back; tokens/s is all generated tokens over the wall time.

    python bench/bench_device.py [--configs static/model_config.json configs/gpt2-small.json] [--batches 5]

Without a CUDA device the GPU rows are left out (and the table says so).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig, TrainConfig  # noqa: E402
from dtrain.node.corpus import load_corpus  # noqa: E402
from dtrain.node.device import CPU, Device, resolve  # noqa: E402
from dtrain.node.model import build_model, tensor_infos  # noqa: E402
from dtrain.node.serve.config import ServeConfig  # noqa: E402
from dtrain.node.serve.engine import Generation, ServeEngine  # noqa: E402
from dtrain.node.serve.sampling import SamplingParams  # noqa: E402
from dtrain.node.serve.weights import FixedWeights  # noqa: E402
from dtrain.node.train.adamw import make_local_optimizer  # noqa: E402
from dtrain.node.tokenizer import load_tokenizer  # noqa: E402
from dtrain.node.train.compute import Compute  # noqa: E402
from dtrain.node.train.gradient import PendingGradient  # noqa: E402

WORDS = "the quick brown fox jumps over the lazy dog while a bard sings of kings and ships and sealing wax".split()


def prompt(i: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 9))  # 3 to 11 words


def train_row(config: ModelConfig, device: Device, batch: int, seq_len: int, batches: int) -> dict:
    model = build_model(config)
    compute = Compute(model, device)
    optimizer = make_local_optimizer(model, TrainConfig())
    params = list(model.parameters())
    pending = PendingGradient([t.elements for t in tensor_infos(model)])
    data, rng = load_corpus(), np.random.default_rng(0)
    pass_ms, step_ms = [], []
    started = None
    for i in range(batches + 1):  # the first batch warms up (allocator, kernels, autotuning)
        if i == 1:
            started = time.perf_counter()
        tokens = data.batch(batch, seq_len, rng)
        t0 = time.perf_counter()
        loss, sums = compute.loss_and_grads(tokens, scale=batch)  # what TrainingNode.local_batch does
        pending.add(sums, batch, batch * loss.item(), local=True)
        t1 = time.perf_counter()
        with torch.no_grad():  # the inner AdamW update of the fp32 master, on the CPU
            for p, acc in zip(params, pending.sums):
                p.grad = (acc / pending.samples).view_as(p)
            optimizer.step()
            for acc in pending.sums:
                acc.zero_()
        pending.samples = 0
        t2 = time.perf_counter()
        if i:
            pass_ms.append((t1 - t0) * 1e3)
            step_ms.append((t2 - t1) * 1e3)
    wall = time.perf_counter() - started
    copy_in = None
    if device.is_cuda:  # of the pass: the master's parameters into the replica (the bench's one look inside)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            compute._sync()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        copy_in = statistics.median(times)
    return {"samples_s": batches * batch / wall, "pass_ms": statistics.median(pass_ms), "copy_in_ms": copy_in,
            "adamw_ms": statistics.median(step_ms), "loss": loss.item()}


def serve_row(config: ModelConfig, device: Device, tok, streams: int, requests: int, max_tokens: int) -> dict:
    engine = ServeEngine(FixedWeights(build_model(config)), lambda ids: tok.decode(list(ids)),
                         ServeConfig(max_batch=max(streams, 8)), eos_token_id=None, device=device.torch_device)
    engine.start()
    try:
        def run(w: int, n: int) -> int:
            done = 0
            for k in range(n):
                ids = tuple(tok.encode(prompt(w * n + k)).ids)
                t = engine.submit(Generation(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)),
                                  lambda e: None)
                t.done.wait(600)
                done += t.completion_tokens
            return done

        run(0, 1)  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            tokens = sum(pool.map(lambda w: run(w, requests), range(streams)))
        return {"tok_s": tokens / (time.perf_counter() - t0)}
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=[str(DEFAULT_STATIC_DIR / "model_config.json"),
                                                     "configs/gpt2-small.json"])
    ap.add_argument("--batch", type=int, default=8, help="sequences per local batch (--local-batch-size)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (--local-seq-len)")
    ap.add_argument("--batches", type=int, default=5, help="timed local batches per row (after one warm-up)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8], help="concurrent /v1 streams")
    ap.add_argument("--requests", type=int, default=2, help="requests per stream")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    args = ap.parse_args()

    devices = [CPU]
    if torch.cuda.is_available():
        devices.append(resolve("cuda"))
    where = " / ".join(d.describe() for d in devices)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads; devices: {where}")
    if len(devices) == 1:
        print("(torch sees no CUDA device here: CPU rows only)")
    tok = load_tokenizer(DEFAULT_STATIC_DIR)
    configs = [(Path(c).name, ModelConfig.load(c)) for c in args.configs]

    print(f"\nTraining, local batches of {args.batch} x {args.seq_len} tokens ({args.batches} timed):\n")
    print("| model | device | samples/s | pass ms | of which parameters in | AdamW ms (CPU) | speedup |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, config in configs:
        base = None
        for device in devices:
            r = train_row(config, device, args.batch, args.seq_len, args.batches)
            base = base or r["samples_s"]
            copy_in = "–" if r["copy_in_ms"] is None else f"{r['copy_in_ms']:.1f}"
            print(f"| {name} | {device.describe()} | {r['samples_s']:.1f} | {r['pass_ms']:.1f} | {copy_in} | "
                  f"{r['adamw_ms']:.1f} | {r['samples_s'] / base:.1f}x |", flush=True)

    print(f"\n/v1 engine, greedy, {args.requests} requests x {args.max_tokens} tokens per stream:\n")
    print("| model | device | streams | tokens/s | speedup |")
    print("|---|---|---:|---:|---:|")
    for name, config in configs:
        for streams in args.streams:
            base = None
            for device in devices:
                r = serve_row(config, device, tok, streams, args.requests, args.max_tokens)
                base = base or r["tok_s"]
                where = "cpu" if not device.is_cuda else f"{device.torch_device} ({device.name})"
                print(f"| {name} | {where}, fp32 | {streams} | {r['tok_s']:.1f} | {r['tok_s'] / base:.1f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
