"""Model download speed over loopback: every tensor in FP16 from a real node, next to plain static files.

Starts a `dtrain-node` subprocess (GPT-2 small, 124M parameters, unless it is not ready within
--start-timeout seconds; then the default static/model_config.json model), downloads every tensor with
GET /api/v1/model/tensor/{id}?format=f16, then serves the same bytes from a plain aiohttp static route
in another subprocess (once as one file, once as one file per tensor) and downloads them with the same
client. Prints a markdown table; the ceiling the node is held to is the static route with one file per tensor. The node's
peak memory (VmHWM, /usr/bin/time -v's maximum resident set size) is printed after the downloads.

    python bench/bench_download.py [--model-config configs/gpt2-small.json] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from tests.nodeproc import NodeProcess, free_port, new_run_id, wait_cpu_idle, wait_until  # noqa: E402

CHUNK_BYTES = 1 << 20


async def _fetch_all(urls: list[str]) -> int:
    """GET every URL in order on one keep-alive connection; returns the bytes received."""
    total = 0
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1)) as session:
        for url in urls:
            async with session.get(url) as r:
                if r.status != 200:
                    raise RuntimeError(f"GET {url}: {r.status}")
                async for chunk in r.content.iter_chunked(CHUNK_BYTES):
                    total += len(chunk)
    return total


def timed(urls: list[str], repeats: int) -> tuple[int, list[float]]:
    times, size = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        size = asyncio.run(_fetch_all(urls))
        times.append(time.perf_counter() - start)
    return size, times


def start_node(model_config: str, timeout_s: float) -> tuple[NodeProcess, str]:
    for config in (model_config, str(REPO / "dtrain" / "static" / "model_config.json")):
        node = NodeProcess("bench", ["--model-config", config, "--target-batch-size", "1"], new_run_id(), cold=True)
        try:
            node.wait_ready(timeout_s)
            return node, config
        except TimeoutError:
            print(f"{config}: node not ready within {timeout_s:.0f}s; falling back", file=sys.stderr)
            node.kill()
        except BaseException:
            node.kill()
            raise
    raise RuntimeError("no node started")


def serve_static(directory: str, port: int) -> None:
    app = web.Application()
    app.router.add_static("/", directory)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", default=str(REPO / "configs" / "gpt2-small.json"))
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds for the node to get ready")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve-static", help=argparse.SUPPRESS)  # internal: run the static server
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_static:
        serve_static(args.serve_static, args.port)
        return

    started = time.perf_counter()
    node, config = start_node(args.model_config, args.start_timeout)
    static_proc = None
    try:
        ready_s = time.perf_counter() - started
        print(f"node idle {wait_cpu_idle(node.proc.pid):.0f}s after it was ready", file=sys.stderr)
        manifest = node.get_json("/api/v1/model/manifest", timeout_s=60)["tensors"]
        urls = [f"{node.url}/api/v1/model/tensor/{t['id']}?format=f16" for t in manifest]
        expected = sum(t["bytes_f16"] for t in manifest)
        asyncio.run(_fetch_all(urls[:2]))  # warm-up: connection, first snapshot reads

        with tempfile.TemporaryDirectory() as d:
            whole = Path(d) / "model.f16"
            with open(whole, "wb") as out:
                for t in manifest:  # the same bytes, one file each and all in one file
                    data = urllib_get(f"{node.url}/api/v1/model/tensor/{t['id']}?format=f16")
                    (Path(d) / f"t{t['id']}.f16").write_bytes(data)
                    out.write(data)
            port = free_port()
            static_proc = subprocess.Popen([sys.executable, __file__, "--serve-static", d, "--port", str(port)],
                                           cwd=REPO)
            base = f"http://127.0.0.1:{port}"
            wait_until(lambda: _up(base + "/model.f16"), 30, "the static server")
            per_urls = [f"{base}/t{t['id']}.f16" for t in manifest]
            # interleaved, one pass of each per round: the machine's noise falls on every server alike
            api_times, per_times, one_times = [], [], []
            for _ in range(args.repeats):
                api_bytes, times = timed(urls, 1)
                api_times += times
                per_bytes, times = timed(per_urls, 1)
                per_times += times
                one_bytes, times = timed([base + "/model.f16"], 1)
                one_times += times
            hwm_kib = _vm_hwm_kib(node.proc.pid)
        assert api_bytes == one_bytes == per_bytes == expected, (api_bytes, one_bytes, per_bytes, expected)
    finally:
        node.kill()
        if static_proc is not None:
            static_proc.terminate()
            static_proc.wait(10)

    params = sum(t["elements"] for t in manifest)
    print(f"\nModel {Path(config).name}: {params:,} parameters, {len(manifest)} tensors, "
          f"{expected / 1e6:.1f} MB in FP16 (node ready in {ready_s:.0f}s)")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"aiohttp {aiohttp.__version__}; {args.repeats} runs each, interleaved, one keep-alive connection, loopback\n")
    ceiling = expected / 1e6 / min(per_times)  # the same requests, served from files by the kernel
    print("| source | requests | MB | best s | MB/s (best) | MB/s (median) | ratio to the ceiling |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, n, times in (("node: /api/v1/model/tensor/{id}?format=f16", len(manifest), api_times),
                           ("aiohttp static route, one file per tensor", len(manifest), per_times),
                           ("aiohttp static route, one file", 1, one_times)):
        mb = expected / 1e6
        print(f"| {name} | {n} | {mb:.1f} | {min(times):.3f} | {mb / min(times):.0f} | "
              f"{mb / statistics.median(times):.0f} | {mb / min(times) / ceiling:.2f} |")
    print(f"\nNode peak memory (VmHWM) after {args.repeats + 2} downloads of every tensor: {hwm_kib / 1024:,.0f} MiB.")
    print("The ceiling is the aiohttp static route with one file per tensor: the same requests, the same bytes.")


def _vm_hwm_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise KeyError("VmHWM")


def urllib_get(url: str) -> bytes:
    import urllib.request
    with urllib.request.urlopen(url, timeout=120) as r:
        return r.read()


def _up(url: str) -> bool:
    try:
        urllib_get(url.rsplit("/", 1)[0] + "/t0.f16")
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
