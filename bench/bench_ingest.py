"""Ingest speed of DGRD packets: decode + validate + accumulate, per mode, on GPT-2-small shapes.

Compares ``bridge.dgrd`` (whole-array numpy; its section walk and Mode 2 check in C when ``bridge._dgrd_native`` is
built) with a straightforward per-entry Python decoder (``struct.unpack_from`` in a loop, then ``acc[i] += w * v`` per
entry) in the same run. The per-entry decoder runs on a slice of the packet (a few tensors) and its rate is scaled;
the table says which slice.

    python bench/bench_ingest.py [--density 0.01] [--dense-elements 10_000_000] [--repeats 5]
    python bench/bench_ingest.py --http [--repeats 5] [--burst 2] [--modes 123]

``--http`` measures ingest against the socket instead: the same packets (Mode 3 on every transformer block) POSTed one
after another to a real ``dtrain-node`` (GPT-2 small), next to a ceiling measured in the same run: an aiohttp server
in another process that only reads the body and answers JSON. The two take turns, ``--burst`` packets each, and each
turn starts once the other server is quiet: what a server does after its answers (the node refills its reserve of
warm body memory, ``bridge.bodybuf``) is not done on the other's time, and is counted in its own CPU. It also reports
how much the node's peak memory (VmHWM, what ``/usr/bin/time -v`` calls maximum resident set size, reset just before)
grows in 20 concurrent uploads.

``--http --stages`` takes the node's Mode 2 request path apart: the packet POSTed to small servers (no node) that
each do one more step of it (``STAGES``), next to the ceiling, in one run.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import struct
import sys
import time
from typing import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E402
from dtrain.bridge import dgrd  # noqa: E402

NODE_ARGS = ("--max-pending-mib", "0", "--rate-limit", "0")  # --http: no pool byte bound (see http_main), no rate limit


def gpt2_small_elements(vocab=50257, d_model=768, n_layer=12, d_ff=3072, n_pos=1024):
    """(name, elements) in GPT2LMHeadModel.named_parameters() order, tied lm_head listed once."""
    out = [("transformer.wte.weight", vocab * d_model), ("transformer.wpe.weight", n_pos * d_model)]
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        out += [(p + "ln_1.weight", d_model), (p + "ln_1.bias", d_model),
                (p + "attn.c_attn.weight", d_model * 3 * d_model), (p + "attn.c_attn.bias", 3 * d_model),
                (p + "attn.c_proj.weight", d_model * d_model), (p + "attn.c_proj.bias", d_model),
                (p + "ln_2.weight", d_model), (p + "ln_2.bias", d_model),
                (p + "mlp.c_fc.weight", d_model * d_ff), (p + "mlp.c_fc.bias", d_ff),
                (p + "mlp.c_proj.weight", d_ff * d_model), (p + "mlp.c_proj.bias", d_model)]
    out += [("transformer.ln_f.weight", d_model), ("transformer.ln_f.bias", d_model)]
    return out


# ---------------------------------------------------------------------------------------------
# the baseline: what one writes without numpy


def naive_ingest(data: bytes, elements, accumulators, weight: float) -> int:
    """Per-entry decode with the same checks, then per-entry apply. Returns entries on the wire."""
    magic, version, flags, _step, id_len = struct.unpack_from("<4sHHII", data, 0)
    if magic != b"DGRD" or version != 1 or flags not in (0, 1) or not 1 <= id_len <= 256:
        raise ValueError("bad header")
    pos = 16
    data[pos:pos + id_len].decode("utf-8")
    pos += id_len
    loss, samples, n_tensors = struct.unpack_from("<fII", data, pos)
    pos += 12
    if not math.isfinite(loss) or samples == 0:
        raise ValueError("bad header")
    staged, seen, entries = [], set(), 0
    for _ in range(n_tensors):
        tid, nnz = struct.unpack_from("<II", data, pos)
        pos += 8
        if tid >= len(elements) or tid in seen:
            raise ValueError("bad tensor id")
        seen.add(tid)
        n = elements[tid]
        idx, vals = [], []
        if nnz == 0:
            for i in range(n):
                (v,) = struct.unpack_from("<e", data, pos)
                pos += 2
                if not math.isfinite(v):
                    raise ValueError("bad value")
                idx.append(i)
                vals.append(v)
            entries += n
        elif flags == 0:
            for _ in range(nnz):
                i, v = struct.unpack_from("<If", data, pos)
                pos += 8
                if i >= n or not math.isfinite(v):
                    raise ValueError("bad entry")
                idx.append(i)
                vals.append(v)
            entries += nnz
        else:
            i = -1
            for _ in range(nnz):
                s, v = struct.unpack_from("<Be", data, pos)
                pos += 3
                i += s + 1
                if i >= n or not math.isfinite(v):
                    raise ValueError("bad entry")
                idx.append(i)
                vals.append(v)
            entries += nnz
        staged.append((tid, idx, vals))
    if pos != len(data):
        raise ValueError("trailing bytes")
    for tid, idx, vals in staged:  # validated: apply
        acc = accumulators[tid]
        for i, v in zip(idx, vals):
            acc[i] += weight * v
    return entries


# ---------------------------------------------------------------------------------------------


def wire_entries(packet: dgrd.Packet) -> int:
    return sum(s.values.size for s in packet.sections)


def time_best(fn, repeats):
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def pick(ids, size_of, budget):
    """The longest run of ids, from the first, whose sizes add up to at most budget."""
    out, total = [], 0
    for tid in ids:
        if total + size_of(tid) > budget:
            break
        out.append(tid)
        total += size_of(tid)
    return out


# ---------------------------------------------------------------------------------------------
# --http: a real node next to the ceiling


STAGES = {  # --stages: what each small server does with a body, each adding one step of the node's request path
    "ceiling": "request.read(), answer (the ceiling)",
    "keep": "request.read(), keep the body (as the node's pool keeps every packet in this run)",
    "body": "bridge.http.read_body into a bridge.bodybuf buffer (huge pages), keep it",
    "decode": "read_body, keep, and dgrd.decode where the node runs it (training_routes.where_ingested)",
}


def serve_ceiling(port: int, keep: bool = False, stage: str = "ceiling", elements: Sequence[int] = ()) -> None:
    """The ceiling: read the whole body, answer the node's JSON. Nothing else; with `keep`, it also keeps every body,
    as the node's pool keeps every packet in this run (so both servers write each packet to fresh memory). A `stage`
    other than "ceiling" is one of STAGES: the node's request path up to that step, without the node."""
    import asyncio
    from aiohttp import web
    from dtrain.bridge.bodybuf import body_buffer
    from dtrain.bridge.http import read_body
    if stage == "decode":  # the ceiling imports nothing of the node's
        from dtrain.bridge.training_routes import where_ingested
    kept = []

    async def submit(request):
        if stage in ("ceiling", "keep"):
            body = await request.read()
        else:
            body = await read_body(request, 1 << 31, body_buffer)
        if stage == "decode":
            await where_ingested(len(body), dgrd.decode, body, elements)
        if keep or stage != "ceiling":
            kept.append(body)
        return web.json_response({"ok": True, "message": "ok", "server_step": 1})
    app = web.Application(client_max_size=1 << 31)
    app.router.add_post("/api/v1/train/submit", submit)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def stages_main(args, packet: bytes, warm_up: list[bytes]) -> None:
    """--stages: the Mode 2 packet POSTed to one small server per STAGES entry, interleaved, in one run."""
    import asyncio
    import json
    import subprocess
    from tests.nodeproc import cpu_seconds, free_port, wait_until
    servers = {}
    try:
        for stage in STAGES:
            port = free_port()
            servers[stage] = (port, subprocess.Popen([sys.executable, __file__, "--serve-ceiling", str(port),
                                                      "--stage", stage, "--density", str(args.density)]))
        for stage, (port, _) in servers.items():
            wait_until(lambda: _up(f"http://127.0.0.1:{port}/"), 60, f"the {stage} server")
            asyncio.run(post_all(f"http://127.0.0.1:{port}/api/v1/train/submit", warm_up))
        times, cpu_s = {s: [] for s in STAGES}, {s: 0.0 for s in STAGES}
        for _ in range(args.repeats):
            for stage, (port, proc) in servers.items():
                cpu = cpu_seconds(proc.pid)
                times[stage] += asyncio.run(post_all(f"http://127.0.0.1:{port}/api/v1/train/submit", [packet] * 2))
                cpu_s[stage] += cpu_seconds(proc.pid) - cpu + settle(proc.pid)
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(10)
    print(f"Mode 2 packet ({len(packet) / 1e6:.2f} MB, GPT-2 small, density {args.density:g}) POSTed to one small "
          f"server per stage, interleaved, {args.repeats} x 2 each, each timed once the one before was quiet (its CPU"
          f" counts until then); {os.cpu_count()} CPUs.\n")
    print("| stage | what the server does | best ms | median ms | server CPU ms per packet | best, ratio to ceiling |")
    print("|---|---|---:|---:|---:|---:|")
    base = min(times["ceiling"])
    for stage, what in STAGES.items():
        t = times[stage]
        print(f"| {stage} | {what} | {1e3 * min(t):.1f} | {1e3 * np.median(t):.1f} "
              f"| {1e3 * cpu_s[stage] / len(t):.1f} | {base / min(t):.2f} |")
    print(json.dumps({s: [round(x * 1e3, 2) for x in t] for s, t in times.items()}), file=sys.stderr)


async def post_all(url: str, packets: list[bytes], concurrent: bool = False) -> list[float]:
    """POST each packet on one keep-alive connection (or all at once); seconds per packet."""
    import asyncio
    import aiohttp
    timeout = aiohttp.ClientTimeout(total=600)
    limit = len(packets) if concurrent else 1
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=limit)) as session:
        async def one(data: bytes) -> float:
            t = time.perf_counter()
            async with session.post(url, data=data,
                                    headers={"Content-Type": "application/octet-stream"}) as r:
                body = await r.json()
                if r.status != 200 or not body.get("ok"):
                    raise RuntimeError(f"POST {url}: {r.status} {body}")
            return time.perf_counter() - t
        if concurrent:
            return list(await asyncio.gather(*(one(p) for p in packets)))
        return [await one(p) for p in packets]


def settle(pid: int) -> float:
    """Wait (bounded) until `pid` is quiet (under 5% of a core over 50 ms, on the nanosecond clock); the CPU seconds
    it used until then: what a server does after its answers."""
    from tests.nodeproc import thread_cpu_seconds, wait_quiet
    return wait_quiet(pid, window_s=0.05, busy_fraction=0.05, timeout_s=10.0, clock=thread_cpu_seconds)[1]


def vm_kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def http_main(args, cases, warm_up: list[bytes]) -> None:
    import asyncio
    import json
    import subprocess
    import tempfile
    from pathlib import Path
    from tests.nodeproc import NodeProcess, cpu_seconds, free_port, new_run_id, wait_cpu_idle, wait_until

    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as d:
        # min_nodes_for_update never reached: every packet stays in the node's pool and none triggers an update, so
        # the training thread takes no CPU from the request path; the pool's byte bound is off (--max-pending-mib 0)
        # because of that: what the run sends (about 1 GB) stays there
        train = json.loads((repo / "dtrain" / "static" / "train_config.json").read_text())
        train["min_nodes_for_update"] = 1_000_000
        (Path(d) / "train.json").write_text(json.dumps(train))
        node = NodeProcess("bench", ["--model-config", str(repo / "configs" / "gpt2-small.json"),
                                     "--train-config", str(Path(d) / "train.json"),
                                     "--target-batch-size", "1", *NODE_ARGS], new_run_id(), cold=True)
        port = free_port()
        ceiling = subprocess.Popen([sys.executable, __file__, "--serve-ceiling", str(port),
                                    *(["--ceiling-keeps-bodies"] if args.ceiling_keeps_bodies else [])], cwd=repo)
        try:
            node.wait_ready(args.start_timeout)
            print(f"node idle {wait_cpu_idle(node.proc.pid):.0f}s after it was ready", file=sys.stderr)
            step = node.get_json("/api/v1/model/info")["step"]
            wait_until(lambda: _up(f"http://127.0.0.1:{port}/"), 30, "the ceiling server")
            # Warm-up, untimed: each server takes the sparse packets of a full run once (Mode 1's 9.9 MB first) before
            # any is timed, so that a --modes 2 run times them in the state a full run does. A fresh ceiling's
            # request.read() spent 12.5-13 ms of CPU per 4 MB packet, and 4.5-5.5 ms once 9.9 MB bodies had passed
            # through it (glibc's malloc serves a body from fresh mmap'd pages until a larger one raised its threshold)
            for u in (f"{node.url}/api/v1/train/submit", f"http://127.0.0.1:{port}/api/v1/train/submit"):
                asyncio.run(post_all(u, [_restep(p, step) for p in warm_up]))
            rows = []
            for mode, data in cases:
                data = _restep(data, step)
                urls = (f"{node.url}/api/v1/train/submit", f"http://127.0.0.1:{port}/api/v1/train/submit")
                pids = dict(zip(urls, (node.proc.pid, ceiling.pid)))
                times, cpu_s, after_s = {u: [] for u in urls}, {u: 0.0 for u in urls}, {u: 0.0 for u in urls}
                for _ in range(args.repeats):  # interleaved: both see the same machine load
                    for u in urls:
                        cpu = cpu_seconds(pids[u])
                        times[u] += asyncio.run(post_all(u, [data] * args.burst))
                        cpu_s[u] += cpu_seconds(pids[u]) - cpu
                        # what a server does after its answers (the node refills its body reserve) is done before
                        # the other is timed, and counted as its own
                        after_s[u] += settle(pids[u])
                mb = len(data) / 1e6
                rows.append((mode, mb, *(mb / min(times[u]) for u in urls), *(mb / np.median(times[u]) for u in urls),
                             *(1e3 * cpu_s[u] / len(times[u]) for u in urls),
                             *(1e3 * after_s[u] / len(times[u]) for u in urls)))
            burst_mode, burst = cases[0][0].split()[0], _restep(cases[0][1], step)
            before_kib = vm_kib(node.proc.pid, "VmRSS")
            reset = _reset_peak(node.proc.pid)  # VmHWM := VmRSS, so the peak read below is the burst's own
            hwm_before = vm_kib(node.proc.pid, "VmHWM")
            asyncio.run(post_all(f"{node.url}/api/v1/train/submit", [burst] * args.concurrent, concurrent=True))
            hwm_after = vm_kib(node.proc.pid, "VmHWM")
        finally:
            node.kill()
            ceiling.terminate()
            ceiling.wait(10)

    print(f"GPT-2 small (configs/gpt2-small.json), density {args.density:g}; each packet POSTed one after another "
          f"on one keep-alive connection, best (and median) of {args.repeats} x {args.burst}, dtrain and ceiling "
          f"interleaved in this run, each timed once the other was quiet. "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}.\n")
    print("| path | packet MB | dtrain MB/s | ceiling MB/s | ratio | median: dtrain / ceiling MB/s (ratio) "
          "| server CPU ms per packet: dtrain + after / ceiling + after (ratio) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, mb, ours, ceil, ours_med, ceil_med, ours_cpu, ceil_cpu, ours_after, ceil_after in rows:
        print(f"| Mode {mode} | {mb:.1f} | {ours:,.0f} | {ceil:,.0f} | {ours / ceil:.2f} "
              f"| {ours_med:,.0f} / {ceil_med:,.0f} ({ours_med / ceil_med:.2f}) "
              f"| {ours_cpu:.1f} + {ours_after:.1f} / {ceil_cpu:.1f} + {ceil_after:.1f} "
              f"({(ceil_cpu + ceil_after) / (ours_cpu + ours_after):.2f}) |")
    print("\nServer CPU: user + system time of the server's process (every thread) over its posts, per packet, then"
          " (+) from its last answer until it was quiet (the node refills its reserve of warm body memory then); the"
          " ratio is ceiling / dtrain of the sums, so it reads like the MB/s ratio, and a loaded machine changes it"
          " less than wall time.")
    mb = len(burst) / 1e6
    base_kib = before_kib if reset else hwm_before
    print(f"\nNode memory: RSS {before_kib / 1024:,.0f} MiB before a burst of {args.concurrent} concurrent "
          f"{mb:.1f} MB uploads (Mode {burst_mode}), peak (VmHWM) {hwm_after / 1024:,.0f} MiB during it: "
          f"+{(hwm_after - base_kib) / 1024:,.0f} MiB for {args.concurrent * mb / 1.048576:,.0f} MiB of packets"
          f" (accepted packets stay in the pool in this run)."
          + ("" if reset else " VmHWM could not be reset: the growth is of the peak before the burst."))


def _http_shape() -> tuple[int, int, int, int, int]:
    """gpt2_small_elements' arguments for the node's model in --http: configs/gpt2-small.json (512 positions)."""
    import json
    cfg = json.load(open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                      "configs", "gpt2-small.json")))
    return cfg["vocab_size"], cfg["d_model"], cfg["n_layers"], cfg["d_ff"], cfg["max_seq_len"]


def _reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux: 5 > /proc/PID/clear_refs); False if not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _restep(data: bytes, step: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<I", out, 8, step)
    return bytes(out)


def _up(url: str) -> bool:
    import urllib.error
    import urllib.request
    try:
        urllib.request.urlopen(url, timeout=2)
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--density", type=float, default=0.01, help="fraction of entries kept (top-k)")
    ap.add_argument("--dense-elements", type=int, default=10_000_000,
                    help="elements in the Mode 3 packet (a subset of the model)")
    ap.add_argument("--naive-entries", type=int, default=150_000,
                    help="entries the per-entry Python decoder gets (its slice)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per mode; best is kept")
    ap.add_argument("--http", action="store_true", help="POST to a real node next to the ceiling server")
    ap.add_argument("--burst", type=int, default=2, help="--http: packets POSTed back to back per turn")
    ap.add_argument("--concurrent", type=int, default=20, help="--http: uploads in the memory burst")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="--http: seconds for the node to start")
    ap.add_argument("--ceiling-keeps-bodies", action="store_true",
                    help="--http: the ceiling keeps every body too, as the node's pool does in this run")
    ap.add_argument("--modes", default="123", help="the modes to measure, e.g. 2 or 123 (default)")
    ap.add_argument("--stages", action="store_true",
                    help="--http: where a Mode 2 request's time goes, one small server per step of the node's path")
    ap.add_argument("--serve-ceiling", type=int, help=argparse.SUPPRESS)  # internal: run the ceiling server
    ap.add_argument("--stage", default="ceiling", choices=list(STAGES), help=argparse.SUPPRESS)  # internal
    args = ap.parse_args()
    if args.serve_ceiling:
        elements = [n for _, n in gpt2_small_elements(*_http_shape())] if args.stage == "decode" else ()
        serve_ceiling(args.serve_ceiling, keep=args.ceiling_keeps_bodies, stage=args.stage, elements=elements)
        return

    named = gpt2_small_elements()
    if args.http:  # the node's model: configs/gpt2-small.json (max_seq_len 512 positions)
        named = gpt2_small_elements(*_http_shape())
    elements = [n for _, n in named]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    sparse = []  # top-k of a random gradient, tensor by tensor to keep memory flat
    for tid, n in enumerate(elements):
        g = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2)
        _, idx, vals = dgrd.topk_sections([g], args.density)[0]
        sparse.append((tid, idx, vals))
    dense_ids = pick(range(2, len(elements)), lambda t: elements[t], args.dense_elements)
    if args.http:  # the Mode 3 row of --http: every transformer block, dense
        dense_ids = [t for t, (name, _) in enumerate(named) if ".h." in name]
    dense = [(tid, None, rng.standard_normal(elements[tid], dtype=np.float32) * np.float32(1e-2))
             for tid in dense_ids if "3" in args.modes]
    gen_s = time.perf_counter() - t0

    nnz_of = lambda t: sparse[t][1].size  # noqa: E731
    slice_sparse = pick(range(2, len(elements)), nnz_of, args.naive_entries)
    # the smallest whole matrix at or over the budget (a prefix would be layer-norm vectors only)
    slice_dense = [min((t for t in dense_ids if elements[t] >= args.naive_entries),
                       key=lambda t: elements[t])]
    span = lambda ids: named[ids[0]][0].removeprefix("transformer.") + (  # noqa: E731
        f" .. {named[ids[-1]][0].removeprefix('transformer.')} ({len(ids)} tensors)"
        if len(ids) > 1 else "")
    cases = [  # mode, packet, packet of the naive slice, slice description
        ("1 (u32 idx, f32)", dgrd.encode(1, "bench", 3.0, 8, sparse, 0),
         dgrd.encode(1, "bench", 3.0, 8, [sparse[t] for t in slice_sparse], 0),
         span(slice_sparse)),
        ("2 (u8 skip, f16)", dgrd.encode(1, "bench", 3.0, 8, sparse, 1),
         dgrd.encode(1, "bench", 3.0, 8, [sparse[t] for t in slice_sparse], 1),
         span(slice_sparse)),
        ("3 (dense f16)", dgrd.encode(1, "bench", 3.0, 8, dense, 0),
         dgrd.encode(1, "bench", 3.0, 8, [d for d in dense if d[0] in slice_dense], 0),
         span(slice_dense)),
    ]

    warm_up = [data for _, data, _, _ in cases[:2]]  # Mode 1, Mode 2
    cases = [c for c in cases if c[0][0] in args.modes]
    if args.http and args.stages:
        stages_main(args, warm_up[1], warm_up)  # the Mode 2 packet
        return
    if args.http:
        http_main(args, [(mode.split()[0] + " " + mode.split(" ", 1)[1], data) for mode, data, _, _ in cases], warm_up)
        return

    accumulators = [np.ones(n, np.float32) for n in elements]  # touched: no page faults timed
    rows = []
    for mode, data, small, slice_desc in cases:
        packet = dgrd.decode(data, elements)
        n = wire_entries(packet)
        dec_s = time_best(lambda: dgrd.decode(data, elements), args.repeats)
        all_s = time_best(lambda: dgrd.accumulate(dgrd.decode(data, elements), accumulators, 0.5),
                          args.repeats)
        t = time.perf_counter()
        n_small = naive_ingest(small, elements, accumulators, 0.5)
        naive_s = time.perf_counter() - t
        # check the baseline agrees with the codec on the slice
        check = [np.zeros(e, np.float32) for e in elements]
        dgrd.accumulate(dgrd.decode(small, elements), check, 1.0)
        ref = [np.zeros(e, np.float32) for e in elements]
        naive_ingest(small, elements, ref, 1.0)
        assert all(np.allclose(a, b) for a, b in zip(check, ref))
        fast_rate, naive_rate = n / all_s, n_small / naive_s
        rows.append((mode, len(data) / 1e6, n, dec_s, all_s, len(data) / 1e6 / all_s, fast_rate,
                     slice_desc, n_small, len(small) / 1e6 / naive_s, naive_rate,
                     fast_rate / naive_rate))

    total = sum(elements)
    print(f"GPT-2 small: {len(elements)} tensors, {total:,} elements; density {args.density:g} "
          f"(top-k of random normal); Mode 3 on {len(dense_ids)} tensors, "
          f"{sum(elements[t] for t in dense_ids):,} elements. numpy {np.__version__}, "
          f"Python {platform.python_version()}, {os.cpu_count()} CPUs. "
          f"Best of {args.repeats}; setup {gen_s:.1f} s.\n")
    print("| mode | packet MB | wire entries | decode+validate s | decode+validate+accumulate s | MB/s "
          "| entries/s | per-entry Python: slice | slice entries | MB/s | entries/s | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]:,} | {r[3]:.4f} | {r[4]:.4f} | {r[5]:,.0f} "
              f"| {r[6]:.3g} | {r[7]} | {r[8]:,} | {r[9]:.2f} | {r[10]:.3g} | {r[11]:,.0f}x |")
    print("\nPer-entry Python ran once on its slice (same checks, validate-then-apply); its rates "
          "are from that slice, the speedup compares entries/s. Mode 2 wire entries include the "
          "zero entries that bridge gaps over 256.")


if __name__ == "__main__":
    main()
