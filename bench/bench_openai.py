"""Serving throughput and latency: the node's /v1 API (continuous batching on the KV cache) next to plain
transformers `generate` (KV cache, one call per request) on the same model, in one run; prints a markdown table.

For each model config and each concurrency C in (1, 8, 32): C streams each send `--requests` requests back to back
(greedy, `--max-tokens` new tokens each, prompts of different lengths). Three servers of the same weights:
- `/v1 over HTTP`: a real aiohttp server on 127.0.0.1 (the routes a node serves, capture off) and streaming
  requests (`stream: true`, the client reads every server-sent event up to `[DONE]`);
- `engine`: the same ServeEngine called in-process (no HTTP), to show what the HTTP layer costs;
- `generate`: `model.generate(use_cache=True)` per request, C threads at once (what serving without a batcher
  does);
- `generate, batched`: static batching, for reference: each round the C prompts left-padded into one `generate`
  call (every request of a round waits for the whole batch; no stream can join or leave it).
tokens/s is all generated tokens over the wall time of a concurrency level; latency is one request's, from
sending it to its last token.

    python bench/bench_openai.py [--configs configs/tiny.json static/model_config.json] [--max-tokens 16]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from dtrain.bridge import http, openai_routes  # noqa: E402
from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig  # noqa: E402
from dtrain.node.model import build_model  # noqa: E402
from dtrain.node.serve.config import ServeConfig  # noqa: E402
from dtrain.node.serve.engine import Generation, ServeEngine  # noqa: E402
from dtrain.node.serve.sampling import SamplingParams  # noqa: E402
from dtrain.node.serve.service import ServeService  # noqa: E402
from dtrain.node.serve.weights import FixedWeights  # noqa: E402
from dtrain.node.tokenizer import load_tokenizer  # noqa: E402

WORDS = "the quick brown fox jumps over the lazy dog while a bard sings of kings and ships and sealing wax".split()
CONCURRENCY = (1, 8, 32)


def prompt(i: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 9))  # 3 to 11 words


class Server:
    """The /v1 routes of a ServeService on 127.0.0.1:<free port>, served from a background thread."""

    def __init__(self, service: ServeService):
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            http.install(app)
            openai_routes.add_routes(app, service)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", 0).start())
            self.port = self._runner.addresses[0][1]
            ready.set()
            self._loop.run_forever()
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("bench server did not start")

    def close(self):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def summary(latencies: list[float], tokens: int, wall_s: float) -> dict:
    q = statistics.quantiles(latencies, n=20, method="inclusive") if len(latencies) > 1 else latencies * 19
    return {"tok_s": tokens / wall_s, "p50_ms": statistics.median(latencies) * 1e3, "p95_ms": q[18] * 1e3}


async def _http_level(port: int, model: str, c: int, requests: int, max_tokens: int) -> dict:
    latencies, tokens = [], 0
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def stream(session, i):
        nonlocal tokens
        body = {"model": model, "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        async with session.post(url, json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = json.loads(line[6:])["usage"]
                    if usage:
                        tokens += usage["completion_tokens"]
        latencies.append(time.perf_counter() - t0)

    async def worker(session, w):
        for k in range(requests):
            await stream(session, w * requests + k)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session, w) for w in range(c)))
        wall = time.perf_counter() - t0
    return summary(latencies, tokens, wall)


def engine_level(engine: ServeEngine, tok, c: int, requests: int, max_tokens: int) -> dict:
    latencies, tokens, lock = [], [0], threading.Lock()

    def worker(w):
        for k in range(requests):
            ids = tuple(tok.encode(prompt(w * requests + k)).ids)
            t0 = time.perf_counter()
            t = engine.submit(Generation(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)), lambda e: None)
            t.done.wait(600)
            with lock:
                latencies.append(time.perf_counter() - t0)
                tokens[0] += t.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        list(pool.map(worker, range(c)))
    return summary(latencies, tokens[0], time.perf_counter() - t0)


def generate_level(model, tok, c: int, requests: int, max_tokens: int) -> dict:
    latencies, tokens, lock = [], [0], threading.Lock()

    def worker(w):
        for k in range(requests):
            ids = torch.tensor([tok.encode(prompt(w * requests + k)).ids])
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                     do_sample=False, use_cache=True, pad_token_id=50256)
            with lock:
                latencies.append(time.perf_counter() - t0)
                tokens[0] += out.shape[1] - ids.shape[1]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        list(pool.map(worker, range(c)))
    return summary(latencies, tokens[0], time.perf_counter() - t0)


def generate_batched_level(model, tok, c: int, requests: int, max_tokens: int) -> dict:
    """Static batching: each round, the C streams' prompts left-padded into one generate call."""
    latencies, tokens = [], 0
    t0 = time.perf_counter()
    for k in range(requests):
        prompts = [tok.encode(prompt(w * requests + k)).ids for w in range(c)]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[50256] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t1 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, use_cache=True,
                                 pad_token_id=50256)
        latencies += [time.perf_counter() - t1] * c
        new = out[:, width:]
        # a row that ended early is padded with eos by generate: count only what it generated
        tokens += sum(int(row.tolist().index(50256)) if 50256 in row.tolist() else len(row) for row in new)
    return summary(latencies, tokens, time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["configs/tiny.json", "static/model_config.json"])
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request")
    p.add_argument("--requests", type=int, default=2, help="requests per stream, back to back")
    args = p.parse_args()
    tok = load_tokenizer(DEFAULT_STATIC_DIR)
    rows = []
    for path in args.configs:
        model_config = ModelConfig.load(path)
        model = build_model(model_config)
        config = ServeConfig(max_batch=max(CONCURRENCY), queue_size=max(CONCURRENCY), max_tokens=args.max_tokens)
        engine = ServeEngine(FixedWeights(model), lambda ids: tok.decode(list(ids)), config, eos_token_id=50256)
        engine.start()
        server = Server(ServeService(engine, tok, model_config.name, config))
        try:
            engine_level(engine, tok, 2, 1, 2)  # warm-up: first weights load, first forwards
            generate_level(model, tok, 1, 1, 2)
            for c in CONCURRENCY:
                results = {
                    "/v1 over HTTP": asyncio.run(_http_level(server.port, model_config.name, c, args.requests,
                                                             args.max_tokens)),
                    "engine": engine_level(engine, tok, c, args.requests, args.max_tokens),
                    "generate": generate_level(model, tok, c, args.requests, args.max_tokens),
                    "generate, batched": generate_batched_level(model, tok, c, args.requests, args.max_tokens),
                }
                rows.append((Path(path).name, c, results))
                print(f"{path} C={c}: " + ", ".join(f"{k} {v['tok_s']:.0f} tok/s" for k, v in results.items()),
                      file=sys.stderr, flush=True)
        finally:
            server.close()
            engine.stop()
    names = ("/v1 over HTTP", "engine", "generate", "generate, batched")
    print(f"\n{args.requests} requests per stream, {args.max_tokens} new tokens each, greedy; "
          f"torch threads {torch.get_num_threads()}\n")
    print("| model | streams | " + " | ".join(f"{n} tok/s" for n in names) + " | "
          + " | ".join(f"{n} p50 / p95 ms" for n in names) + " | /v1 vs generate tok/s |")
    print("|---|---:|" + "---:|" * (2 * len(names) + 1))
    for name, c, r in rows:
        print(f"| {name} | {c} | " + " | ".join(f"{r[n]['tok_s']:.0f}" for n in names) + " | "
              + " | ".join(f"{r[n]['p50_ms']:.0f} / {r[n]['p95_ms']:.0f}" for n in names)
              + f" | {r['/v1 over HTTP']['tok_s'] / r['generate']['tok_s']:.2f}x |")


if __name__ == "__main__":
    main()
