"""What a low-comm joiner's state costs on the wire, and what a smaller form of it would cost: prints two tables.

A joiner downloads the swarm's state of one epoch: the anchor (the parameters the swarm serves) and the outer Nesterov
momentum. The anchor must arrive exact: it is the served step's bytes. The momentum must be the swarm's bytes too,
since every peer's next outer step reads it and equal steps must give equal bytes; so a lossy momentum on the wire
means the swarm keeping its momentum in that form, every peer rounding it the same way after each outer step. The
node keeps it in 8 bits (node.lowcomm.momentum: the last encoding below, 5.02 bytes per parameter with the anchor);
this bench measures the forms against f32 (8 bytes per parameter).

The bench trains the default model in one process as a low-comm node does: --rounds outer rounds of --inner-steps
AdamW updates (the node's parameter groups and settings) on the packaged corpus, then the outer Nesterov step (the
node's learning rate and momentum) from the round's anchor. On the state it reached:

1. bytes per parameter of each encoding, and its encode and decode speed on this machine: f32; the
   same bytes split into byte planes and deflated (zlib level 1, lossless); the momentum in bf16, or 8-bit with an
   f32 scale per 256 values (absmax), beside the anchor in f32.
2. what keeping the momentum in a lossy form costs the training: from that state, --after more rounds on the same
   batches, once with the momentum in f32 and once per lossy form (rounded after every outer step). Reported: the
   held-out loss after them, and how far the parameters ended from the f32 run's, relative to how far that run
   moved them (`drift`).

    .venv/bin/python bench/bench_state_encoding.py [--rounds 20 --after 20 --inner-steps 10 --batch 8x64]
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig, TrainConfig  # noqa: E402
from dtrain.node.corpus import load_corpus  # noqa: E402
from dtrain.node.model import build_model  # noqa: E402
from dtrain.node.train.adamw import decay_groups  # noqa: E402

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # the node's defaults (--outer-lr, --outer-momentum)
BLOCK = 256  # values per scale of the 8-bit form


# ---- encodings of one flat f32 vector: (encode, decode); encode returns the bytes that would move ----------------

def deflate_planes(x: np.ndarray) -> bytes:
    planes = x.view(np.uint8).reshape(-1, 4).T  # byte 0 of every value, then byte 1, ...: the exponents compress
    return zlib.compress(np.ascontiguousarray(planes).tobytes(), 1)


def inflate_planes(blob: bytes, n: int) -> np.ndarray:
    planes = np.frombuffer(zlib.decompress(blob), np.uint8).reshape(4, n)
    return np.ascontiguousarray(planes.T).view(np.float32).reshape(-1)


def to_bf16(x: np.ndarray) -> bytes:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def from_bf16(blob: bytes, n: int) -> np.ndarray:
    return torch.from_numpy(np.frombuffer(blob, np.int16).copy()).view(torch.bfloat16).float().numpy()


def to_int8(x: np.ndarray) -> bytes:
    pad = (-len(x)) % BLOCK
    blocks = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, BLOCK)
    scale = np.abs(blocks).max(axis=1).astype(np.float32) / 127.0
    q = np.round(blocks / np.where(scale > 0, scale, 1.0)[:, None]).astype(np.int8)
    return scale.tobytes() + q.tobytes()


def from_int8(blob: bytes, n: int) -> np.ndarray:
    blocks = -(-n // BLOCK)
    scale = np.frombuffer(blob[:4 * blocks], np.float32)
    q = np.frombuffer(blob[4 * blocks:], np.int8).reshape(blocks, BLOCK)
    return (q.astype(np.float32) * scale[:, None]).reshape(-1)[:n]


LOSSY = {"bf16": (to_bf16, from_bf16), "8-bit absmax": (to_int8, from_int8)}


# ---- the low-comm training of one node ----------------------------------------------------------------------------

class Run:
    """A model, its inner AdamW, the anchor and the outer momentum: one node's low-comm state."""

    def __init__(self, model: torch.nn.Module, train: TrainConfig):
        self.model = model
        self.params = [p for p in model.parameters()]
        self.inner = torch.optim.AdamW(decay_groups(model, train.weight_decay), lr=train.learning_rate,
                                       betas=(train.beta1, train.beta2), eps=train.eps)
        self.anchor = [p.detach().clone() for p in self.params]
        self.momentum = [torch.zeros_like(p) for p in self.params]

    def fork(self) -> "Run":
        return copy.deepcopy(self)

    def round(self, batches, store: Callable[[torch.Tensor], torch.Tensor] = lambda m: m) -> None:
        for tokens in batches:
            loss = self.model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            self.inner.step()
            self.inner.zero_grad(set_to_none=True)
        with torch.no_grad():  # Nesterov SGD on the pseudo-gradient, as node.lowcomm.outer.OuterNesterov
            for p, a, m in zip(self.params, self.anchor, self.momentum):
                delta = a - p
                m.mul_(OUTER_MOMENTUM).add_(delta)
                m.copy_(store(m))
                a.sub_(OUTER_LR * (delta + OUTER_MOMENTUM * m))
                p.copy_(a)

    @torch.no_grad()
    def loss(self, batches) -> float:
        return float(np.mean([self.model(input_ids=t, labels=t).loss.item() for t in batches]))


def flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()


def timed(fn, *args) -> tuple[object, float]:
    began = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="outer rounds before the state is measured")
    ap.add_argument("--after", type=int, default=20, help="outer rounds from it per momentum form")
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--batch", default="8x64", help="sequences x tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    batch, seq = map(int, args.batch.split("x"))
    torch.manual_seed(args.seed)
    config = ModelConfig.load(DEFAULT_STATIC_DIR / "model_config.json")
    train = TrainConfig.load(DEFAULT_STATIC_DIR / "train_config.json")
    data, rng = load_corpus(), np.random.default_rng(args.seed)

    def batches(n):
        return [torch.from_numpy(data.batch(batch, seq, rng).astype(np.int64)) for _ in range(n)]

    held_out = batches(8)
    run = Run(build_model(config), train)
    params = sum(p.numel() for p in run.params)
    print(f"default model, {params:,} parameters; {args.rounds} rounds of {args.inner_steps} inner updates at "
          f"{args.batch} on the packaged corpus", file=sys.stderr)
    began = time.monotonic()
    for r in range(args.rounds):
        run.round(batches(args.inner_steps))
        print(f"round {r + 1}: held-out loss {run.loss(held_out):.4f} ({time.monotonic() - began:.0f}s)",
              file=sys.stderr)

    anchor, momentum = flat(run.anchor), flat(run.momentum)
    n = len(anchor)
    rows = [("f32", 4.0, 4.0, 0.0, 0.0)]
    (a_blob, a_enc), (m_blob, m_enc) = timed(deflate_planes, anchor), timed(deflate_planes, momentum)
    (a_back, a_dec), (m_back, m_dec) = timed(inflate_planes, a_blob, n), timed(inflate_planes, m_blob, n)
    assert np.array_equal(a_back.view(np.uint32), anchor.view(np.uint32))
    assert np.array_equal(m_back.view(np.uint32), momentum.view(np.uint32))
    rows.append(("byte planes + zlib 1 (lossless)", len(a_blob) / n, len(m_blob) / n, a_enc + m_enc, a_dec + m_dec))
    for name, (enc, dec) in LOSSY.items():
        blob, enc_s = timed(enc, momentum)
        _, dec_s = timed(dec, blob, n)
        rows.append((f"anchor f32, momentum {name}", 4.0, len(blob) / n, enc_s, dec_s))
    print(f"\nThe state after {args.rounds} rounds ({n:,} parameters):\n")
    print("| encoding | anchor B/param | momentum B/param | B/param | MB | s at 20 Mbit/s | encode s | decode s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, a_bpp, m_bpp, enc_s, dec_s in rows:
        total = (a_bpp + m_bpp) * n
        print(f"| {name} | {a_bpp:.2f} | {m_bpp:.2f} | {a_bpp + m_bpp:.2f} | {total / 1e6:.1f} | "
              f"{total * 8 / 20e6:.0f} | {enc_s:.2f} | {dec_s:.2f} |")

    after = batches(args.after * args.inner_steps)
    rounds = [after[i:i + args.inner_steps] for i in range(0, len(after), args.inner_steps)]
    start = flat(run.anchor)
    exact = run.fork()
    for r in rounds:
        exact.round(r)
    moved = np.linalg.norm(flat(exact.anchor) - start)
    print(f"\nKeeping the momentum in a lossy form: {args.after} more rounds on the same batches\n")
    print("| momentum kept in | held-out loss | drift from f32 |")
    print("|---|---:|---:|")
    print(f"| f32 | {exact.loss(held_out):.4f} | 0 |")
    for name, (enc, dec) in LOSSY.items():
        lossy = run.fork()

        def store(m: torch.Tensor) -> torch.Tensor:
            flat = m.reshape(-1).numpy()
            return torch.from_numpy(dec(enc(flat), len(flat))).view_as(m)

        lossy.momentum = [store(m) for m in lossy.momentum]  # as a joiner receives it
        for r in rounds:
            lossy.round(r, store)
        drift = np.linalg.norm(flat(lossy.anchor) - flat(exact.anchor)) / moved
        print(f"| {name} | {lossy.loss(held_out):.4f} | {drift:.4f} |")


if __name__ == "__main__":
    main()
