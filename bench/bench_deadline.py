"""Two low-comm sparse nodes in namespaces, joined over an unshaped link, then both uploads shaped with tbf to
RATE Mbit/s: how many rounds abort, how many complete, and the deadlines the node goes through; once with the
nodes of each tree given (a tree without measured deadlines: the floor alone).
    flock /tmp/dtrain-heavy.lock .venv/bin/python bench/bench_deadline.py RATE SECONDS TREE [TREE ...]

Each TREE is a checkout of dtrain whose nodes are run (python -m dtrain.cli from its root); the harness is this
one's (tests/netns.py, tests/nodeproc.py). Runs as root (namespaces), under the heavy lock.
"""
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tests.nodeproc as nodeproc  # noqa: E402
from tests.netns import Net  # noqa: E402
from tests.nodeproc import TINY_CONFIG, NodeProcess, new_run_id, wait_until  # noqa: E402

RATE, SECONDS, TREES = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:] or ["."]
TEXT = "/work/shared/data/tinyshakespeare.txt"
common = ["--model-config", str(TINY_CONFIG), "--local-batch-size", "4", "--local-seq-len", "64", "--sync",
          "low-comm", "--wire-codec", "sparse", "--topk-fraction", "0.2", "--inner-steps", "2", "--link-mbit", "0",
          "--averaging-timeout", "5", "--wait-for-peers", "2", "--train-data", TEXT]


def measure(tree: str) -> None:
    nodeproc.REPO = Path(tree)  # the nodes run that tree's dtrain (python -m dtrain.cli from its root)
    run_id, nodes = new_run_id(), []
    with Net() as net:
        hosts = [net.host(f"m{i}") for i in range(2)]
        try:
            a = NodeProcess("A", common, run_id, netns=hosts[0], host_maddrs=f"/ip4/{hosts[0].ip}/tcp/0", cold=True)
            nodes.append(a)
            a.wait_ready(300)
            peers = [m for m in a.status()["maddrs"] if m.startswith(f"/ip4/{hosts[0].ip}/")]
            b = NodeProcess("B", common, run_id, initial_peers=peers, netns=hosts[1],
                            host_maddrs=f"/ip4/{hosts[1].ip}/tcp/0", cold=True)
            nodes.append(b)
            b.wait_ready(300)
            wait_until(lambda: min(n.status()["step"] for n in nodes) >= 3, 300, "two rounds unshaped")
            unshaped = [l for l in a.output().splitlines() if "Averaged gradients with 2" in l]
            for h in hosts:
                h.run(["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", f"{int(RATE * 1000)}kbit",
                       "burst", "16384", "latency", "200ms"])
            mark = len(a.output().splitlines())
            step0, t0 = a.status()["step"], time.monotonic()
            first_done = None
            while time.monotonic() - t0 < SECONDS:
                time.sleep(1.0)
                lines = a.output().splitlines()[mark:]
                if first_done is None and any("Averaged gradients with 2" in l for l in lines):
                    first_done = time.monotonic() - t0
            lines = a.output().splitlines()[mark:]
            aborted = [l for l in lines if "Gradient averaging failed" in l]
            done = [l for l in lines if "Averaged gradients with 2" in l]
            print(f"{tree}: {RATE:g} Mbit/s for {SECONDS:.0f}s after {len(unshaped)} unshaped rounds: "
                  f"{len(done)} rounds averaged, {len(aborted)} failed; first averaged after "
                  f"{'never' if first_done is None else f'{first_done:.0f}s'}; node A's step {step0} -> "
                  f"{a.status()['step']}", flush=True)
            for l in lines:
                if re.search(r"deadline|Gradient averaging failed|Averaged gradients", l):
                    print("   ", l[-260:], flush=True)
        finally:
            for n in nodes:
                n.kill()


for tree in TREES:
    measure(tree)
