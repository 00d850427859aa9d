"""How fast a real `dtrain-node` trains next to a plain PyTorch loop on the same hardware: prints one markdown table.

For each model config and batch shape, one after the other on this machine:

1. plain: the loop a PyTorch user would write. The model the node builds (node.model.build_model), batches of
   --batch sequences of --seq-len tokens drawn as the node draws them (TokenDataset.batch over the same text,
   tokenized as the node tokenizes its --train-data), torch.optim.AdamW with the node's parameter groups and
   settings (train.adamw.decay_groups, static/train_config.json), loss.backward(), step(),
   zero_grad(set_to_none=True). On a GPU: bf16 autocast (where the node uses it) and fused AdamW. A few steps warm
   up, then steps run until --window seconds are up; samples/s is steps x batch over the timed steps' wall time
   (CUDA synchronized before and after).
2. node alone: one `python -m dtrain.cli` process of the tree this bench lives in (PYTHONPATH set to it), default
   flags except the model, the text (--train-data), the batch shape, the device, the --sync mode, --node-args, a
   free --port and a run id of its own, listening on 127.0.0.1 only. After it printed its join hint, it warms up for
   --warmup seconds and until its first update; then its `/api/v1/swarm/status` is read twice: right after an update,
   and right after the first update at least --window seconds later (whole cycles of updates: a low-comm node's
   samples count as it trains them and its outer round comes after, so a window cut across a cycle would leave the
   round out or count it whole). The samples it trained are applied_samples + pending_samples (pending: trained,
   not yet applied by an (outer) update; an update moves them to applied, so the sum only grows); samples/s is the
   difference over the time between the reads.
3. two nodes: node A as above until its first update, then node B with A's printed multiaddrs as --initial-peers
   and the same flags. The window opens (at A's next update) once B has made an update of the swarm since it
   answered, A trained since B was ready, and --warmup seconds went by since then; the swarm's samples/s is the
   sum of both nodes' differences over the same window (closed at one of A's updates, as above). The ratio is to ONE plain loop: the two nodes share this machine's cores.

tokens/s is samples/s x the sequence length. The last column is the CPU time per second of the window of what
was measured (the bench's process, the nodes' process trees) and of every other process on the machine (from
/proc/stat): a row measured while other work was running is low, and says so. Before each window the bench waits
(at most --quiet-wait seconds) for other processes to go quiet. Each row's counts, updates and group sizes in the
window go to stderr as it runs; the nodes' logs are kept in a temporary directory when a node fails (its last
lines are printed).

Heavy: run it alone on the machine, under the lock, e.g.
    flock /tmp/dtrain-heavy.lock .venv/bin/python bench/bench_hardware.py --device cpu --configs default \\
        --window 40 --runs alone swarm --modes low-comm
    .venv/bin/python bench/bench_hardware.py [--configs default configs/gpt2-small.json] [--device cpu|cuda|auto]
        [--shapes 8x64 16x512] [--modes low-comm per-step] [--runs alone swarm] [--window 60] [--warmup 30]
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dtrain.node.assets import tokenizer_files  # noqa: E402
from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig, TrainConfig  # noqa: E402
from dtrain.node.corpus import default_text  # noqa: E402
from dtrain.node.data import TokenDataset  # noqa: E402
from dtrain.node.device import Device, resolve  # noqa: E402
from dtrain.node.model import build_model  # noqa: E402
from dtrain.node.train.adamw import decay_groups  # noqa: E402
from bench.bench_memory import gpu_bytes_by_pid, held_bytes, tree  # noqa: E402
from bench.proc_cpu import busiest_thread_seconds, cpu_seconds, machine_cpu_seconds  # noqa: E402
from dtrain.node.tokenizer import load_tokenizer  # noqa: E402
from bench.hardware_nodes import Node, NodeFailed, say, wait_for  # noqa: E402  (last: say's clock starts here)

UPDATE_RE = re.compile(r"update (\d+): (\d+) samples.*?; \d+ packets, (\d+) peers(?:, \d+ inner updates)?, took ([\d.]+)s")
PLAIN_WARMUP_STEPS = 3
GIB = 1 << 30


# ---- the plain loop ----------------------------------------------------------------------------------------------

def plain_loop(config: ModelConfig, device: Device, data: TokenDataset, batch: int, seq_len: int,
               window_s: float) -> dict:
    train = TrainConfig.load(DEFAULT_STATIC_DIR / "train_config.json")  # what the node loads by default
    model = build_model(config).to(device.torch_device)  # eval mode, as the node's (dropout is 0 anyway)
    params = sum(p.numel() for p in model.parameters())
    if device.is_cuda:
        torch.cuda.reset_peak_memory_stats(device.torch_device)
    extra = {"fused": True} if device.is_cuda else {}
    opt = torch.optim.AdamW(decay_groups(model, train.weight_decay), lr=train.learning_rate,
                            betas=(train.beta1, train.beta2), eps=train.eps, **extra)
    rng = np.random.default_rng(0)

    def sync():
        if device.is_cuda:
            torch.cuda.synchronize(device.torch_device)

    def step():
        x = torch.from_numpy(data.batch(batch, seq_len, rng).astype(np.int64)).to(device.torch_device)
        with device.autocast():
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    try:
        for _ in range(PLAIN_WARMUP_STEPS):
            step()
        sync()
        steps, started, cpu0, all0 = 0, time.perf_counter(), time.process_time(), machine_cpu_seconds()
        while True:
            loss = step()
            steps += 1
            if time.perf_counter() - started >= window_s:
                break
        sync()
        wall = time.perf_counter() - started
        return {"samples_s": steps * batch / wall, "steps": steps, "wall": wall, "loss": loss.item(),
                "cores": (time.process_time() - cpu0) / wall, "params": params,
                "others": (machine_cpu_seconds() - all0 - (time.process_time() - cpu0)) / wall,
                "gpu_gib": torch.cuda.max_memory_reserved(device.torch_device) / GIB if device.is_cuda else None}
    finally:
        del model, opt
        gc.collect()
        if device.is_cuda:
            torch.cuda.empty_cache()


# ---- real nodes --------------------------------------------------------------------------------------------------

def wait_quiet(nodes: list, max_wait_s: float, busy_cores: float = 0.3, sample_s: float = 3.0) -> None:
    """Wait (at most max_wait_s) until the processes other than this one and the nodes' trees use under
    `busy_cores` of the machine over `sample_s`: a window is not opened while other work runs, if it can be helped."""
    def ours() -> float:
        return cpu_seconds([n.proc.pid for n in nodes] + [p for n in nodes for p in tree(n.proc.pid)[1:]])

    deadline = time.monotonic() + max_wait_s
    while True:
        all0, mine0, ours0, t0 = machine_cpu_seconds(), time.process_time(), ours(), time.monotonic()
        time.sleep(sample_s)
        for node in nodes:
            node.alive()
        others = (machine_cpu_seconds() - all0 - (time.process_time() - mine0) - ours() + ours0) / (
            time.monotonic() - t0)
        if others < busy_cores:
            return
        if time.monotonic() >= deadline:
            say(f"  other processes still use {others:.2f} cores after {max_wait_s:.0f}s of waiting: timing anyway")
            return
        say(f"  other processes use {others:.2f} cores: waiting for the machine to be quiet")


def after_update(node: Node, nodes: list[Node], timeout_s: float) -> None:
    """Returns once `node` made its next update (its status's count of updates grew), read every 0.25 s."""
    before = node.status()["updates"]
    wait_for(f"an update of {node.name}'s", lambda: node.status()["updates"] > before, nodes, timeout_s,
             interval_s=0.25)


def window(nodes: list[Node], window_s: float, quiet_wait_s: float) -> list[dict]:
    """Each node's samples trained over the same window (two status reads), with its updates in between. The window
    is whole cycles of updates: it opens right after an update of the first node's and closes right after the first
    of its updates at least `window_s` later, so that it holds its outer rounds in proportion (a low-comm node's
    samples count as it trains them, its round is paid later: a window shorter than a cycle, or cut across one,
    shows its inner loop's speed without the round)."""
    wait_quiet(nodes, quiet_wait_s)
    cycle_wait_s = max(600.0, 5 * window_s)
    after_update(nodes[0], nodes, cycle_wait_s)
    first = [node.trained() for node in nodes]
    cpu0 = [cpu_seconds([n.proc.pid, *tree(n.proc.pid)[1:]]) for n in nodes]
    children0 = [cpu_seconds(tree(n.proc.pid)[1:]) for n in nodes]
    threads0 = [busiest_thread_seconds(n.proc.pid)[1] for n in nodes]
    all0, mine0 = machine_cpu_seconds(), time.process_time()
    opened = time.monotonic()
    while time.monotonic() - opened < window_s:
        for node in nodes:
            node.alive()
        time.sleep(min(0.5, max(0.0, window_s - (time.monotonic() - opened))))
    after_update(nodes[0], nodes, cycle_wait_s)
    cpu1 = [cpu_seconds([n.proc.pid, *tree(n.proc.pid)[1:]]) for n in nodes]
    children = [cpu_seconds(tree(n.proc.pid)[1:]) - c0 for n, c0 in zip(nodes, children0)]
    busiest = [busiest_thread_seconds(n.proc.pid, t0)[0] for n, t0 in zip(nodes, threads0)]
    cpu_wall = time.monotonic() - opened
    others = (machine_cpu_seconds() - all0 - (time.process_time() - mine0) - sum(cpu1) + sum(cpu0)) / cpu_wall
    last = [node.trained() for node in nodes]
    on_gpu = gpu_bytes_by_pid()
    out = []
    for node, (c0, t0, s0), (c1, t1, s1), u0, u1, kids, trainer in zip(nodes, first, last, cpu0, cpu1, children,
                                                                       busiest):
        pids = tree(node.proc.pid)
        groups = [int(m.group(3)) for line in node.output(t0, t1) if (m := UPDATE_RE.search(line))]
        out.append({"name": node.name, "samples": c1 - c0, "seconds": t1 - t0, "samples_s": (c1 - c0) / (t1 - t0),
                    "updates": s1["updates"] - s0["updates"], "groups": groups, "peers": s1.get("training_peers"),
                    "carried": s1["carried_samples"] - s0["carried_samples"], "cores": (u1 - u0) / cpu_wall,
                    "trainer_cores": trainer / cpu_wall, "children_cores": kids / cpu_wall,
                    "others": others, "host_gib": held_bytes(node.proc.pid) / GIB,
                    "gpu_gib": sum(on_gpu.get(p, 0) for p in pids) / GIB if on_gpu else None})
    return out


@dataclass
class NodeRun:
    model_config: Path
    text: Path
    batch: int
    seq_len: int
    device: str
    mode: str
    window_s: float
    warmup_s: float
    ready_timeout_s: float
    quiet_wait_s: float
    workdir: Path
    extra: tuple[str, ...] = ()  # --node-args
    failures: list = field(default_factory=list)

    def args(self) -> list[str]:
        return ["--model-config", str(self.model_config), "--train-data", str(self.text),
                "--local-batch-size", str(self.batch), "--local-seq-len", str(self.seq_len),
                "--device", self.device, "--sync", self.mode, *self.extra]

    def run(self, kind: str) -> Optional[list[dict]]:
        run_id, nodes = f"bench-hw-{uuid.uuid4().hex[:8]}", []
        try:
            nodes.append(a := Node("A", self.args(), run_id, self.workdir))
            say(f"  node A started (port {a.port}): {shlex.join(a.argv[1:])}")
            maddrs = a.wait_ready(self.ready_timeout_s)
            ready = time.monotonic()
            say(f"  node A ready after {ready - a.started:.0f}s; warming up")
            wait_for("A's first update", lambda: a.status()["updates"] >= 1, nodes, self.ready_timeout_s)
            if kind == "alone":
                rest = self.warmup_s - (time.monotonic() - ready)
                if rest > 0:
                    wait_for(f"{self.warmup_s:.0f}s of warm-up", lambda: time.monotonic() - ready >= self.warmup_s,
                             nodes, rest + 5)
            else:
                if not maddrs:
                    raise NodeFailed("node A printed no 127.0.0.1 multiaddr")
                nodes.append(b := Node("B", self.args(), run_id, self.workdir, initial_peers=tuple(maddrs)))
                say(f"  node B started (port {b.port}), --initial-peers {' '.join(maddrs)}")
                b.wait_ready(self.ready_timeout_s)
                joined = time.monotonic()
                b_updates, b_count, a_count = b.status()["updates"], b.trained()[0], a.trained()[0]
                say(f"  node B ready after {joined - b.started:.0f}s (at update {b_updates}); waiting for both to "
                    f"train and {self.warmup_s:.0f}s of warm-up")

                def both_training():  # an update of B's (a download moves its updates too) and samples of both
                    return (b.status()["updates"] > b_updates and b.trained()[0] > b_count
                            and a.trained()[0] > a_count and time.monotonic() - joined >= self.warmup_s)
                wait_for("an update of B's since it answered, both training, and the warm-up", both_training, nodes,
                         self.ready_timeout_s + self.warmup_s)
            say(f"  window of {self.window_s:.0f}s opens")
            return window(nodes, self.window_s, self.quiet_wait_s)
        except (NodeFailed, OSError, KeyError, ValueError) as e:
            say(f"  FAILED: {e}")
            self.failures.append(f"{kind} {self.mode}: {e}")
            for node in nodes:
                say(f"  --- node {node.name}'s last lines ({node.log_path}) ---\n{node.tail()}")
            return None
        finally:
            for node in nodes:  # SIGTERM to every node at once, then up to 30 s for them all
                node.terminate()
            deadline = time.monotonic() + 30.0
            for node in nodes:
                node.stop(deadline - time.monotonic())
            say(f"  {'node' if len(nodes) == 1 else 'nodes'} stopped")


def memory_cell(host_gib: Optional[float], gpu_gib: Optional[float], fp32_bytes: int) -> str:
    host = "–" if host_gib is None else f"{host_gib:.2f} ({host_gib * GIB / fp32_bytes:.1f}x)"
    return f"{host} / {'–' if gpu_gib is None else f'{gpu_gib:.2f}'}"


# ---- main --------------------------------------------------------------------------------------------------------

def shape(text: str) -> tuple[int, int]:
    try:
        b, s = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is BATCHxSEQ_LEN, e.g. 8x64; got {text!r}") from None
    if b < 1 or s < 2:
        raise argparse.ArgumentTypeError(f"batch must be >= 1 and seq len >= 2, got {text!r}")
    return b, s


def config_path(text: str) -> Path:
    if text == "default":
        return DEFAULT_STATIC_DIR / "model_config.json"
    path = Path(text)
    return (path if path.is_absolute() or path.exists() else REPO / path).resolve()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["default", "configs/gpt2-small.json"],
                    help="model config JSONs; 'default' is the node's default model (static/model_config.json)")
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (a CUDA GPU when torch sees one)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per local batch (--local-batch-size)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (--local-seq-len)")
    ap.add_argument("--shapes", nargs="+", type=shape, help="several BATCHxSEQ_LEN shapes (instead of --batch and "
                                                            "--seq-len), e.g. 8x64 16x512")
    ap.add_argument("--modes", nargs="+", choices=["low-comm", "per-step"], default=["low-comm"],
                    help="--sync of the node rows")
    ap.add_argument("--runs", nargs="+", choices=["alone", "swarm"], default=["alone", "swarm"],
                    help="node rows: one node alone, two nodes on 127.0.0.1")
    ap.add_argument("--text", type=Path, help="text file to train on (default: the packaged corpus, written to a "
                                              "temporary file for the nodes' --train-data)")
    ap.add_argument("--node-args", default="", help="more dtrain-node flags for every node row, e.g. "
                    "\"--torch-threads 1\" (two nodes that share the cores then do not oversubscribe them)")
    ap.add_argument("--window", type=float, default=60.0, help="timed seconds of each node row at least (whole cycles "
                                                               "of updates; the plain loop's exactly)")
    ap.add_argument("--warmup", type=float, default=30.0, help="node rows: seconds after ready (or after B joined) "
                                                               "before the window, and at least until an update")
    ap.add_argument("--ready-timeout", type=float, default=300.0,
                    help="seconds a node may take to be ready, to make its first update, or B to update with A")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="seconds to wait, before each timed window, for other processes on the machine to use under "
                         "0.3 cores (then it is timed anyway; the table shows how busy they were)")
    args = ap.parse_args()
    shapes = args.shapes or [(args.batch, args.seq_len)]

    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed (a timeout): the finally blocks stop the nodes
    device = resolve(args.device)
    node_device = str(device.torch_device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; device {device.describe()}; code: {REPO}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-hw-"))
    rows, failures = [], []
    started = time.monotonic()
    try:
        if args.text is None:
            text = workdir / "corpus.txt"
            say("writing the packaged corpus as text (the nodes' --train-data)")
            text.write_text(default_text(), encoding="utf-8")
        else:
            text = args.text.resolve()
        tokenizer = load_tokenizer(tokenizer_files(DEFAULT_STATIC_DIR))  # what the node tokenizes --train-data with
        data = TokenDataset.from_text_file(text, tokenizer)
        say(f"text {text}: {len(data):,} tokens")
        for path in map(config_path, args.configs):
            config = ModelConfig.load(path)
            name = "default" if path == config_path("default") else path.stem
            for batch, seq_len in shapes:
                seq = min(seq_len, config.max_seq_len)  # what the node trains on (TrainingNode.local_batch)
                label = f"{batch}x{seq}"
                t0 = time.monotonic()
                say(f"{name} {label} on {node_device}: plain loop, {PLAIN_WARMUP_STEPS} warm-up steps and "
                    f"{args.window:.0f}s")
                wait_quiet([], args.quiet_wait)
                plain = plain_loop(config, device, data, batch, seq, args.window)
                say(f"  plain: {plain['steps']} steps in {plain['wall']:.1f}s, {plain['samples_s']:.2f} samples/s, "
                    f"last loss {plain['loss']:.3f}, {plain['cores']:.2f} cores busy (other processes: "
                    f"{plain['others']:.2f}), load average {os.getloadavg()[0]:.2f} ({time.monotonic() - t0:.0f}s)")
                base = plain["samples_s"]
                fp32 = plain["params"] * 4
                rows.append((name, device.describe(), label, "–", "plain", base, seq, base, plain["cores"],
                             plain["others"], memory_cell(None, plain["gpu_gib"], fp32)))
                for mode in args.modes:
                    for kind in args.runs:
                        t0 = time.monotonic()
                        what = ("node alone" if kind == "alone" else "two nodes") + \
                            (f", {args.node_args}" if args.node_args else "")
                        say(f"{name} {label} on {node_device}, {mode}: {what}")
                        runner = NodeRun(path, text, batch, seq_len, node_device, mode, args.window, args.warmup,
                                         args.ready_timeout, args.quiet_wait, workdir,
                                         tuple(shlex.split(args.node_args)))
                        per_node = runner.run(kind)
                        failures += runner.failures
                        if per_node is None:
                            rows.append((name, device.describe(), label, mode, what, None, seq, base, None, None,
                                         ""))
                            continue
                        for n in per_node:
                            together = sum(1 for g in n["groups"] if g > 1)
                            say(f"  {n['name']}: {n['samples']} samples in {n['seconds']:.1f}s = "
                                f"{n['samples_s']:.2f}/s; {n['updates']} updates in the window ({together} of them "
                                f"logged with a group of 2+ peers), training_peers {n['peers']}, carried "
                                f"{n['carried']} samples, {n['cores']:.2f} cores busy (its process tree: "
                                f"{n['trainer_cores']:.2f} its busiest thread, the training thread's (torch's "
                                f"other threads do part of it), {n['children_cores']:.2f} hivemind's processes "
                                f"and p2pd), "
                                f"{memory_cell(n['host_gib'], n['gpu_gib'], fp32)} GiB host / GPU")
                        rate = sum(n["samples_s"] for n in per_node)
                        cores = sum(n["cores"] for n in per_node)
                        say(f"  {what}: {rate:.2f} samples/s, {rate / base:.2f}x the plain loop, load average "
                            f"{os.getloadavg()[0]:.2f} ({time.monotonic() - t0:.0f}s)")
                        biggest = max(per_node, key=lambda n: n["host_gib"])
                        rows.append((name, device.describe(), label, mode, what, rate, seq, base, cores,
                                     per_node[0]["others"], memory_cell(biggest["host_gib"], biggest["gpu_gib"], fp32)))
    finally:
        print(f"\n{len(rows)} rows in {time.monotonic() - started:.0f}s; window {args.window:.0f}s, warm-up "
              f"{args.warmup:.0f}s\n")
        print("| config | device | shape | mode | run | samples/s | tokens/s | ratio to plain | cores busy: "
              "measured / other processes | memory per node: host / GPU GiB |")
        print("|---|---|---|---|---|---:|---:|---:|---:|---:|")
        for name, where, label, mode, what, rate, seq, base, cores, others, held in rows:
            if rate is None:
                print(f"| {name} | {where} | {label} | {mode} | {what} | failed | | | | |")
            else:
                print(f"| {name} | {where} | {label} | {mode} | {what} | {rate:.2f} | {rate * seq:,.0f} | "
                      f"{rate / base:.2f}x | {cores:.2f} / {others:.2f} | {held} |")
        print("\nmemory per node: what the node's process tree holds on the host (bench_memory.held_bytes, at the "
              "window's end; x its fp32 parameters' bytes) and on the GPU (nvidia-smi); the plain loop's GPU figure is "
              "torch's peak reserved memory; two nodes: the larger node")
        print(f"\ncores busy: CPU seconds per second of the window, of what was measured (the bench's process for "
              f"plain, the nodes' process trees) and of every other process on this machine ({os.cpu_count()} "
              f"cores; /proc/stat); a row with other processes busy is low. Load average at the end: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
        for failure in failures:
            print(f"\nfailed: {failure}")
        if failures:
            print(f"\nthe nodes' logs: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
