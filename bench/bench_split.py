"""Split-inference latency on the shared model (static/model_config.json): prints markdown tables.

- per-token latency against context length, incremental (KV cache) vs full recompute, WebSocket vs HTTP
  (client time: embedding lookup + round trip + LM head + argmax);
- greedy tokens/s through the split client next to transformers `generate` on the same model;
- HE-LoRA encrypt / compute / decrypt milliseconds for one rank-8 expert.

The node side runs in this process (a real aiohttp server on 127.0.0.1 in a background thread) with
the model saved as a `--split-model` directory, so the numbers include JSON, base64 and HTTP/WS framing.

    python bench/bench_split.py [--model-config static/model_config.json] [--reps 5]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiohttp import web  # noqa: E402

from dtrain.bridge import http, split_routes  # noqa: E402
from dtrain.clients.split_client import SplitClient  # noqa: E402
from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig  # noqa: E402
from dtrain.node.model import build_model  # noqa: E402
from dtrain.node.split.config import SplitConfig  # noqa: E402
from dtrain.node.split.experts import LoraExpert  # noqa: E402
from dtrain.node.split.service import from_pretrained  # noqa: E402


class Server:
    """The split routes of a service on 127.0.0.1:<free port>, served from a background thread."""

    def __init__(self, service):
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._service = service
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("bench server did not start")

    def _run(self):
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        http.install(app)
        split_routes.add_routes(app, self._service)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", 0).start())
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._ready.set()
        self._loop.run_forever()

    def close(self):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def step_latency(client: SplitClient, ids: list[int], incremental: bool, reps: int) -> float:
    """Median seconds for one next token with len(ids) tokens of context."""
    times = []
    for _ in range(reps):
        sid = uuid.uuid4().hex
        if incremental:
            client.forward(client.embed(ids[:-1]), sid, incremental=False)  # the cache of the context, untimed
        t0 = time.perf_counter()
        if incremental:
            pre = client.forward(client.embed(ids[-1:]), sid, incremental=True)
        else:
            pre = client.forward(client.embed(ids), None, incremental=False)
        int(np.argmax(client.logits(pre[-1:])[0]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default=str(DEFAULT_STATIC_DIR / "model_config.json"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--gen-tokens", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    mc = ModelConfig.load(args.model_config)
    model = build_model(mc)
    tmp = Path(tempfile.mkdtemp(prefix="bench-split-"))
    model.save_pretrained(tmp / "model")
    rng = np.random.default_rng(0)
    LoraExpert.from_matrices("bench", rng.normal(scale=0.05, size=(8, mc.d_model)),
                             rng.normal(scale=0.05, size=(mc.d_model, 8)), 2.0).save(tmp / "expert")
    service = from_pretrained(tmp / "model", SplitConfig(experts=(("bench", str(tmp / "expert")),)))
    server = Server(service)
    t_total = time.perf_counter()
    try:
        ws = SplitClient(server.url, transport="ws")
        web_ = SplitClient(server.url, transport="http")
        max_len = mc.max_seq_len
        ids_all = rng.integers(0, mc.vocab_size, size=max_len).tolist()
        print(f"## split inference on {mc.name}: d={mc.d_model}, layers={mc.n_layers}, max_seq_len={max_len}, "
              f"torch threads {torch.get_num_threads()}\n")
        print("### Per-token latency (ms, median of %d) against context length\n" % args.reps)
        print("| context | WS incremental | WS full recompute | HTTP incremental | HTTP full recompute |")
        print("|---:|---:|---:|---:|---:|")
        for L in sorted({8, 64, 256, max_len} & set(range(2, max_len + 1))):
            ids = ids_all[:L]
            row = [median_ms([step_latency(c, ids, inc, args.reps)]) for c in (ws, web_) for inc in (True, False)]
            print(f"| {L} | {row[0]:.1f} | {row[1]:.1f} | {row[2]:.1f} | {row[3]:.1f} |")

        print("\n### Greedy generation: %d new tokens after an 8-token prompt\n" % args.gen_tokens)
        print("| path | tokens/s |")
        print("|---|---:|")
        prompt = ids_all[:8]
        with torch.no_grad():
            model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
            t0 = time.perf_counter()
            model.generate(torch.tensor([prompt]), max_new_tokens=args.gen_tokens, do_sample=False,
                           min_new_tokens=args.gen_tokens, pad_token_id=0)
            hf = args.gen_tokens / (time.perf_counter() - t0)
        for name, client, inc in (("split client, WS, incremental", ws, True),
                                  ("split client, HTTP, incremental", web_, True),
                                  ("split client, WS, full recompute", ws, False)):
            t0 = time.perf_counter()
            n = len(client.generate(prompt, args.gen_tokens, incremental=inc))
            print(f"| {name} | {n / (time.perf_counter() - t0):.1f} |")
        print(f"| transformers generate (same model, in process, no network) | {hf:.1f} |")

        print("\n### HE-LoRA (rank 8, CKKS N=8192) per call, ms (median of %d)\n" % args.reps)
        print("| seq_len | encrypt | compute | decrypt | total call | plaintext expert call |")
        print("|---:|---:|---:|---:|---:|---:|")
        for T in (1, 8):
            hidden = ws.embed(ids_all[:T])
            rows = {True: [], False: []}
            for _ in range(args.reps):
                for he in (True, False):
                    ws._client.expert_name, ws._client.use_he = "bench", he
                    ws.forward(hidden)
                    rows[he].append(ws.last_answer)
            ws._client.expert_name, ws._client.use_he = None, False
            med = {k: statistics.median(a[k] for a in rows[True]) for k in ("encrypt_ms", "compute_ms", "decrypt_ms", "total_ms")}
            plain = statistics.median(a["total_ms"] for a in rows[False])
            print(f"| {T} | {med['encrypt_ms']:.1f} | {med['compute_ms']:.1f} | {med['decrypt_ms']:.1f} | "
                  f"{med['total_ms']:.1f} | {plain:.1f} |")
        ws.close()
        web_.close()
    finally:
        server.close()
    print(f"\n(bench ran {time.perf_counter() - t_total:.0f} s)")


if __name__ == "__main__":
    main()
