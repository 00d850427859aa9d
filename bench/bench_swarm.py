"""The lossless swarm, measured: real nodes on 127.0.0.1, contributors on every node, and the time of an update
next to a bare hivemind.Optimizer swarm with the same model, peers, batch and timeouts.

Table 1, for 1, 2 and 3 nodes: packets accepted, applied and carried (missed an update and went into a later one),
seconds per update while contributions flow, and the longest time two nodes served one step with different bytes.
Table 2: seconds per update of three peers training on local data (8 samples each, target 24), dtrain nodes
against bare hivemind.Optimizer peers, run one after the other in this process.

    .venv/bin/python bench/bench_swarm.py [--rounds 6] [--epochs 8]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dtrain.node.corpus import default_text  # noqa: E402
from tests.nodeproc import PER_STEP, REPO, TINY_CONFIG, NodeProcess, new_run_id, start_swarm, wait_until  # noqa: E402
from tests.swarmcheck import ByteWatch, Contributions, all_applied  # noqa: E402

TIMEOUTS = dict(matchmaking=2.5, averaging=8.0, request=1.0)  # tests/nodeproc.py's, for both swarms


def contributors_row(n: int, rounds: int, train_config: Path) -> dict:
    # per-step mode: every packet's update on every node, and the s/update of a bare hivemind.Optimizer to compare
    nodes = start_swarm(n, [*PER_STEP, "--model-config", str(TINY_CONFIG), "--train-config", str(train_config)],
                        new_run_id())
    try:
        step0 = nodes[0].status()["step"]
        contributions = Contributions(tensor_elements=nodes[0].get_json("/api/v1/model/manifest")["tensors"][0]
                                      ["elements"])
        rng = random.Random(n)
        began = time.monotonic()
        with ByteWatch(nodes) as watch:
            for r in range(rounds):
                contributions.round(nodes, 2, tag=f"r{r}")
                time.sleep(rng.uniform(0.0, 3.0))
            wait_until(lambda: all_applied(nodes), 300, "every packet applied", 1.0)
        elapsed = time.monotonic() - began
        statuses = [node.status() for node in nodes]
        updates = statuses[0]["step"] - step0
        return dict(nodes=n, accepted=sum(s["accepted_packets"] for s in statuses),
                    applied=sum(s["applied_packets"] for s in statuses),
                    carried=sum(s["carried_packets"] for s in statuses), updates=updates,
                    s_per_update=elapsed / max(updates, 1), split_s=watch.split_s, conflicts=len(watch.conflicts))
    finally:
        for node in nodes:
            node.kill()


def dtrain_update_s(epochs: int, text: Path) -> float:
    args = [*PER_STEP, "--model-config", str(TINY_CONFIG), "--train-data", str(text), "--local-batch-size", "8",
            "--local-seq-len", "32", "--local-samples-per-update", "8", "--target-batch-size", "24"]
    nodes = start_swarm(3, args, new_run_id())
    try:
        joined = max(min(node.digests()) for node in nodes)
        wait_until(lambda: min(max(node.digests()) for node in nodes) >= joined + epochs, 600, "updates", 1.0)
        return _seconds_per_update([_times_of_steps(node) for node in nodes], joined, epochs)
    finally:
        for node in nodes:
            node.kill()


def _times_of_steps(node: NodeProcess) -> dict[int, float]:
    """step -> when the node logged it (seconds of the day, from the log's timestamp)."""
    out = {}
    for line in node.output().splitlines():
        if " params sha256 " in line and "] step " in line:
            clock = line.split()[2]
            h, m, s = clock.split(":")
            out[int(line.split("] step ")[1].split()[0])] = int(h) * 3600 + int(m) * 60 + float(s)
    return out


def _seconds_per_update(timelines: list[dict[int, float]], first: int, epochs: int) -> float:
    """Over the steps every peer logged from `first` on, about `epochs` of them: a joiner that downloaded a step
    never logged making it."""
    common = sorted(set.intersection(*(set(t) for t in timelines)))
    begin = min(s for s in common if s >= first)
    end = max(s for s in common if s <= begin + epochs)
    assert end > begin, f"no two steps from {first} on that every peer logged: {common}"
    return (max(t[end] for t in timelines) - max(t[begin] for t in timelines)) / (end - begin)


def bare_update_s(epochs: int) -> float:
    run_id = new_run_id()
    base = [sys.executable, str(REPO / "bench" / "hivemind_peer.py"), "--run-id", run_id, "--model-config",
            str(TINY_CONFIG), "--epochs", str(epochs + 2), "--matchmaking-time", str(TIMEOUTS["matchmaking"]),
            "--averaging-timeout", str(TIMEOUTS["averaging"]), "--request-timeout", str(TIMEOUTS["request"])]
    first = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    maddr = next(line.split()[1] for line in first.stdout if line.startswith("MADDR"))
    peers = [first] + [subprocess.Popen([*base, "--initial-peers", maddr], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    try:
        timelines = []
        for peer in peers:
            out, _ = peer.communicate(timeout=900)
            timelines.append({int(w[1]): float(w[2]) for w in (line.split() for line in out.splitlines())
                              if w and w[0] == "epoch"})
        first_common = max(min(t) for t in timelines)
        return _seconds_per_update(timelines, first_common, epochs - 1)
    finally:
        for peer in peers:
            peer.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="rounds of 2 contributors per node")
    p.add_argument("--epochs", type=int, default=8, help="updates timed in table 2")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        train_config = Path(tmp) / "train.json"
        train_config.write_text(json.dumps({"learning_rate": 0.01, "weight_decay": 0.0, "min_nodes_for_update": 1}))
        text = Path(tmp) / "text.txt"
        text.write_text(default_text(10_000)[:30_000])
        print("| nodes | accepted packets | applied | carried | updates | s per update | longest split s |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n in (1, 2, 3):
            row = contributors_row(n, args.rounds, train_config)
            print(f"| {row['nodes']} | {row['accepted']} | {row['applied']} | {row['carried']} | {row['updates']} | "
                  f"{row['s_per_update']:.1f} | {row['split_s']:.1f} |", flush=True)
        dtrain_s = dtrain_update_s(args.epochs, text)
        bare_s = bare_update_s(args.epochs)
        print("\n| 3 peers, tiny model, 8 samples each, target 24 | s per update | ratio |")
        print("|---|---:|---:|")
        print(f"| bare hivemind.Optimizer | {bare_s:.2f} | 1.00 |")
        print(f"| dtrain-node | {dtrain_s:.2f} | {dtrain_s / bare_s:.2f} |")


if __name__ == "__main__":
    main()
