"""Train the default model on the packaged Shakespeare corpus with one node, then with three, and take it out.

    .venv/bin/python examples/train_corpus.py                      # about 20 minutes on 2 CPU cores
    .venv/bin/python examples/train_corpus.py --samples 800 --nodes 1   # a short look

Each run starts real `dtrain-node` processes on 127.0.0.1 with the default model (dtrain/static/model_config.json)
and default flags (low-comm rounds: 10 inner AdamW updates of 8 sequences of 64 tokens, then an outer step), the
second and third joined to the first with --initial-peers and every node holding back until all have joined
(--wait-for-peers N), so that each run starts from the same seeded weights. Every node trains on the same text file:
the packaged corpus (dtrain/data/, dtrain.node.corpus) without its last --held-out-fraction of tokens; each node
draws its own random windows of it. A run ends once its nodes together have applied --samples samples.

Held-out loss: the mean next-token cross-entropy (nats per token) of the model node A serves, on 128 windows of 64
tokens spread evenly over the corpus's held-out tail, which no node trains on (the end of the last plays in file-name
order). During a run the script downloads node A's weights at --points evenly spaced sample counts (the weights are
evaluated after the run, so evaluation takes no CPU from training); the curve goes into a PNG (examples/pngplot.py).
At the end of each run the model is exported with `dtrain-export --node URL --out DIR`, and plain transformers
(`AutoModelForCausalLM.from_pretrained(DIR)`, `AutoTokenizer.from_pretrained(DIR)`) generates a few lines from it.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dtrain.clients.export import ExportError, from_node  # noqa: E402
from dtrain.node import hfdir  # noqa: E402
from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig  # noqa: E402
from dtrain.node.corpus import default_tokens  # noqa: E402
from dtrain.node.model import build_model  # noqa: E402
from dtrain.node.tokenizer import load_tokenizer  # noqa: E402
from pngplot import line_plot  # noqa: E402

MODEL_CONFIG = DEFAULT_STATIC_DIR / "model_config.json"
EVAL_WINDOWS, EVAL_SEQ = 128, 64  # held-out windows x tokens; 64 is the nodes' --local-seq-len
PROMPTS = ("HAMLET.\n", "KING.\nMy lord,", "Now is the winter of")
START_TIMEOUT_S = 300.0  # a node's imports, tokenizing the corpus, a joiner's download of the state
HTTP_TIMEOUT_S = 10.0


@dataclass
class Point:
    samples: int  # the nodes' applied samples, summed, when the weights were downloaded
    step: int
    params: dict  # name -> float32 tensor, node A's model at that step
    loss: float = math.nan  # held-out, filled in after the run


@dataclass
class Run:
    nodes: int
    points: list[Point] = field(default_factory=list)
    train_minutes: float = 0.0  # from every node ready to the last sample counted
    wall_minutes: float = 0.0  # from the first node's start to the export
    samples: int = 0
    per_node: list[int] = field(default_factory=list)  # each node's applied samples at the end: who took part
    export_dir: Optional[Path] = None
    export_loss_hf: float = math.nan  # the exported directory's held-out loss, computed by transformers
    lines: list[str] = field(default_factory=list)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2400, help="samples a run's nodes apply together before it ends")
    p.add_argument("--nodes", default="1,3", help="runs, as comma-separated node counts")
    p.add_argument("--points", type=int, default=5, help="held-out evaluations per run (the seeded start not counted)")
    p.add_argument("--max-minutes", type=float, default=11.0, help="a run that has not reached --samples by then "
                                                                   "ends with the samples it has")
    p.add_argument("--held-out-fraction", type=float, default=0.05, help="the corpus's tail no node trains on")
    p.add_argument("--png", default=str(REPO / "docs" / "train_corpus.png"), help="where to write the loss curve")
    p.add_argument("--work-dir", help="node logs, the training text and the exported models (default: a temporary "
                                      "directory, removed at the end)")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens generated per prompt")
    args = p.parse_args(argv)
    try:
        args.node_counts = [int(n) for n in args.nodes.split(",")]
    except ValueError:
        p.error(f"--nodes takes comma-separated node counts, e.g. 1,3; got {args.nodes!r}")
    if not args.node_counts or min(args.node_counts) < 1:
        p.error(f"--nodes: every run needs at least one node; got {args.nodes!r}")
    if args.samples < 1 or args.points < 1:
        p.error("--samples and --points must be at least 1")
    if not 0.0 < args.held_out_fraction < 0.5:
        p.error(f"--held-out-fraction must be in (0, 0.5), got {args.held_out_fraction}")
    return args


def split_corpus(fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): the packaged corpus cut before its last `fraction` of tokens."""
    tokens = default_tokens()
    cut = int(len(tokens) * (1.0 - fraction))
    return tokens[:cut], tokens[cut:]


def eval_windows(held: np.ndarray) -> torch.Tensor:
    """(EVAL_WINDOWS, EVAL_SEQ) token ids starting at evenly spaced offsets of the held-out tokens."""
    starts = np.linspace(0, len(held) - EVAL_SEQ, EVAL_WINDOWS).astype(np.int64)
    return torch.from_numpy(np.stack([held[s:s + EVAL_SEQ] for s in starts]).astype(np.int64))


def held_out_loss(model: torch.nn.Module, windows: torch.Tensor, batch: int = 32) -> float:
    """Mean next-token cross-entropy over every window (nats per token); the model is dtrain's or transformers'."""
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=windows[i:i + batch], labels=windows[i:i + batch]).loss.item() * len(
            windows[i:i + batch]) for i in range(0, len(windows), batch)]
    return sum(losses) / len(windows)


# ---- nodes ------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One `dtrain-node` process (python -m dtrain.cli) with its log in a file."""

    def __init__(self, name: str, flags: list[str], log_dir: Path):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"node-{name}.log"
        cmd = [sys.executable, "-m", "dtrain.cli", "--host", "127.0.0.1", "--port", str(self.port),
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *flags]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)

    def get_json(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())

    def status(self) -> dict:
        return self.get_json("/api/v1/swarm/status")

    def wait_ready(self) -> dict:
        """The node's status once its bridge answers (it listens once the node has joined the swarm)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"node {self.name} exited with {self.proc.returncode}; its log ends:\n"
                                 + self.log.read_text()[-3000:])
            try:
                return self.status()
            except (urllib.error.URLError, OSError):
                time.sleep(1.0)
        raise SystemExit(f"node {self.name} did not answer within {START_TIMEOUT_S:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # a clean stop also ends its DHT and averager processes
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def applied(nodes: list[Node]) -> tuple[int, int]:
    """(node A's step, the samples every node has applied, summed)."""
    statuses = [node.status() for node in nodes]
    return statuses[0]["step"], sum(s["applied_samples"] for s in statuses)


def samples_at(fetch, nodes: list[Node]) -> tuple[int, int, object]:
    """fetch() -> (step, value) while the nodes train: (step, the samples applied when node A served that step,
    value). Updates during the fetch are counted in proportion (a lone node applies the same samples each update;
    a swarm's outer round outlasts a fetch)."""
    step0, samples0 = applied(nodes)
    step, value = fetch()
    step1, samples1 = applied(nodes)
    if step1 == step0:
        return step, samples1, value
    return step, round(samples0 + (step - step0) * (samples1 - samples0) / (step1 - step0)), value


def download(node: Node) -> tuple[int, dict]:
    """(step, params) of the node's model, one consistent step checked against its sha256."""
    exported, _ = from_node(node.url)
    return exported.step, exported.params


def export(node: Node, out: Path) -> tuple[int, dict]:
    """`dtrain-export --node URL --out DIR`; (step, params) of the directory it wrote."""
    done = subprocess.run([sys.executable, "-m", "dtrain.clients.export", "--node", node.url, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"dtrain-export failed: {done.stderr.strip()[-2000:]}")
    print(f"  {done.stdout.strip()}", flush=True)
    return int(re.search(r" at step (\d+),", done.stdout).group(1)), hfdir.read(out).params


def train(n: int, args, train_file: Path, work: Path) -> Run:
    run = Run(nodes=n)
    log_dir = work / f"logs-{n}"
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = ["--run-id", f"corpus-{n}-{uuid.uuid4().hex[:8]}", "--train-data", str(train_file),
             "--wait-for-peers", str(n)]
    label = f"[{n} node{'s' if n > 1 else ''}]"
    began = time.monotonic()
    nodes = [Node("A", flags, log_dir)]
    try:
        maddrs = [m for m in nodes[0].wait_ready()["maddrs"] if m.startswith("/ip4/127.0.0.1/")]
        nodes += [Node("ABCDEFGH"[i] if i < 8 else str(i), [*flags, "--initial-peers", *maddrs], log_dir)
                  for i in range(1, n)]
        for node in nodes[1:]:
            node.wait_ready()
        print(f"{label} {n} node(s) up after {time.monotonic() - began:.0f} s; logs in {log_dir}", flush=True)
        ready = time.monotonic()
        targets = [args.samples * (k + 1) // args.points for k in range(args.points)]
        shown = 0.0
        while len(run.points) < len(targets) - 1:
            samples = applied(nodes)[1]
            elapsed = time.monotonic() - ready
            if elapsed > args.max_minutes * 60:
                print(f"{label} --max-minutes {args.max_minutes:g} reached with {samples} samples", flush=True)
                break
            if samples >= targets[len(run.points)]:
                step, samples, params = samples_at(lambda: download(nodes[0]), nodes)
                run.points.append(Point(samples, step, params))
                print(f"{label} {elapsed / 60:5.1f} min: step {step} at {samples} samples "
                      f"({samples / max(elapsed, 1e-9):.1f}/s) downloaded for evaluation", flush=True)
            elif elapsed - shown >= 30.0:
                losses = nodes[0].get_json("/api/v1/server/losses")
                train_loss = f"training loss {losses[-1]:.3f}" if losses else "no update yet"
                print(f"{label} {elapsed / 60:5.1f} min: {samples}/{args.samples} samples, {train_loss}", flush=True)
                shown = elapsed
            time.sleep(1.0)
        # the curve ends on the exported model: what transformers generates from
        while applied(nodes)[1] < targets[-1] and time.monotonic() - ready < args.max_minutes * 60:
            time.sleep(1.0)
        run.export_dir = work / f"model-{n}-nodes"
        print(f"{label} dtrain-export --node {nodes[0].url} --out {run.export_dir}", flush=True)
        step, samples, params = samples_at(lambda: export(nodes[0], run.export_dir), nodes)
        run.train_minutes = (time.monotonic() - ready) / 60
        run.points.append(Point(samples, step, params))
        run.samples = samples
        run.per_node = [node.status()["applied_samples"] for node in nodes]
        run.wall_minutes = (time.monotonic() - began) / 60
    finally:
        for node in nodes:
            node.stop()
    return run


# ---- after a run ----------------------------------------------------------------------------------------------

def evaluate(run: Run, windows: torch.Tensor, seeded: Point) -> None:
    model = build_model(ModelConfig.load(MODEL_CONFIG))
    for point in run.points:
        hfdir.load_params(model, point.params)
        point.loss = held_out_loss(model, windows)
    run.points.insert(0, seeded)


def generate(run: Run, windows: torch.Tensor, max_new_tokens: int) -> None:
    """Plain transformers on the exported directory: its held-out loss (the same windows), and a few lines."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run.export_dir)
    tokenizer = AutoTokenizer.from_pretrained(run.export_dir)
    run.export_loss_hf = held_out_loss(model, windows)
    torch.manual_seed(0)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                             pad_token_id=tokenizer.eos_token_id)
        run.lines.append(tokenizer.decode(out[0]))


def main(argv: Optional[Sequence[str]] = None) -> list[Run]:
    args = parse_args(argv)
    started = time.monotonic()
    train_tokens, held = split_corpus(args.held_out_fraction)
    windows = eval_windows(held)
    seeded_model = build_model(ModelConfig.load(MODEL_CONFIG))  # every run starts from these weights
    seeded = Point(0, 1, {}, held_out_loss(seeded_model, windows))
    del seeded_model
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="train-corpus-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        train_file = work / "train.txt"
        train_file.write_text(load_tokenizer().decode(train_tokens.tolist()), encoding="utf-8")
        print(f"corpus: {len(train_tokens):,} tokens to train on, {len(held):,} held out ({EVAL_WINDOWS} windows of "
              f"{EVAL_SEQ} tokens evaluated); seeded weights' held-out loss {seeded.loss:.3f}", flush=True)
        runs = []
        for n in args.node_counts:
            run = train(n, args, train_file, work)
            evaluate(run, windows, seeded)
            generate(run, windows, args.max_new_tokens)
            for p in run.points:
                p.params = {}  # 64 MB each
            runs.append(run)
            print(f"[{n} node{'s' if n > 1 else ''}] held-out loss " + ", ".join(
                f"{p.loss:.3f} @ {p.samples}" for p in run.points), flush=True)
        line_plot(args.png, [(f"{r.nodes} node{'s' if r.nodes > 1 else ''}", [p.samples for p in r.points],
                              [p.loss for p in r.points]) for r in runs],
                  x_label="samples applied (sequences of 64 tokens)", y_label="held-out loss (nats/token)",
                  title="default model on the packaged corpus: held-out loss")
        print(f"\nwrote {args.png}\n")
        print("| nodes | samples | minutes training | minutes in all | held-out loss | transformers' loss of the "
              "export |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in runs:
            print(f"| {r.nodes} | {r.samples} | {r.train_minutes:.1f} | {r.wall_minutes:.1f} | "
                  f"{r.points[-1].loss:.3f} | {r.export_loss_hf:.3f} |")
        for r in runs:
            print(f"\n{r.nodes} node(s), each node's applied samples {r.per_node}; generated by transformers from "
                  f"{r.export_dir.name}:")
            for line in r.lines:
                print("  " + repr(line))
        print(f"\nseeded weights' held-out loss {seeded.loss:.3f}; total {(time.monotonic() - started) / 60:.1f} "
              "minutes", flush=True)
        return runs
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
