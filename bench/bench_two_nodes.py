"""Two training nodes on this machine: node A trains on a text file, node B joins it (A's multiaddrs as
--initial-peers, downloading A's state) and trains too, both apply an averaged update, and A answers a
/v1/completions request. What fits, and what the join costs in memory.

Printed: the memory each node's process tree holds (bench_memory.held_bytes) when A is ready, at
B's peak while it joins, and at each node's peak over the run; the machine's lowest MemAvailable; the seconds from
B's start to its first served step (its download included) and from its first download line to that step; the first
update both nodes served with the same parameters after B joined (its group of peers, from the node's log); and
A's completion. Both nodes are killed at once if MemAvailable falls under --min-available-gib.

Under the heavy lock, alone on the machine as far as can be (check `free -g` first):
    flock /tmp/dtrain-heavy.lock .venv/bin/python bench/bench_two_nodes.py --model-config configs/gpt2-medium.json \
        --sync per-step
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_memory import GIB, TEXT, MemoryWatch  # noqa: E402
from tests.nodeproc import NodeProcess, new_run_id, wait_until  # noqa: E402

SAMPLE_EVERY_S = 0.25
PEERS_RE = re.compile(r"update (\d+): \d+ samples.*?; \d+ packets, (\d+) peers")
DOWNLOAD_RE = re.compile(r"Loading the swarm's parameters and optimizer state|Downloading \d+ ranges of the state")


def stamp(node: NodeProcess, pattern: re.Pattern, watch: MemoryWatch, timeout_s: float, after: str = "") -> float:
    """When a line matching `pattern` first shows in the node's output after the first line that holds `after`
    (polled every 0.1 s)."""
    def seen():
        watch.check()
        out = node.output()
        return after in out and pattern.search(out, out.index(after))
    wait_until(seen, timeout_s, f"{node.name}: {pattern.pattern}", 0.1)
    return time.monotonic()


def complete(node: NodeProcess, prompt: str, max_tokens: int) -> str:
    models = node.get_json("/v1/models", timeout_s=60)["data"]
    body = json.dumps({"model": models[0]["id"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    request = urllib.request.Request(node.url + "/v1/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["text"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", type=Path, required=True)
    ap.add_argument("--sync", choices=["per-step", "low-comm"], default="low-comm")
    ap.add_argument("--text", type=Path, default=TEXT, help="the text file both nodes train on")
    ap.add_argument("--min-available-gib", type=float, default=2.0)
    ap.add_argument("--averaging-timeout", type=float, default=120.0,
                    help="seconds: a round of GPT-2 medium's state over 127.0.0.1 on 2 cores takes tens of them")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for each stage")
    ap.add_argument("--samples-per-update", type=int, default=1,
                    help="--local-samples-per-update of both nodes: per-step, a joiner keeps up only when a download "
                         "takes less than the swarm's update")
    ap.add_argument("--rounds", type=int, default=1,
                    help="averaged updates both nodes serve before A is asked for a completion (training together)")
    ap.add_argument("--prompt", default="ROMEO:")
    a = ap.parse_args()
    args = ["--model-config", str(a.model_config), "--sync", a.sync, "--train-data", str(a.text),
            "--local-batch-size", "1", "--local-seq-len", "64", "--local-samples-per-update", str(a.samples_per_update),
            "--matchmaking-time", "15", "--request-timeout", "5", "--averaging-timeout", str(a.averaging_timeout)]
    run_id, rows = new_run_id(), {}
    nodes: list[NodeProcess] = []
    with MemoryWatch(nodes, a.min_available_gib, interval_s=SAMPLE_EVERY_S) as watch:
        try:
            nodes.append(node_a := NodeProcess("A", args, run_id, cold=True))
            maddrs = node_a.wait_ready(a.timeout)
            wait_until(lambda: watch.check() or node_a.status()["updates"] >= 1, a.timeout, "A's first update", 1.0)
            rows["A ready and trained"] = dict(watch.last)
            started = time.monotonic()
            nodes.append(node_b := NodeProcess("B", args, run_id, initial_peers=maddrs, cold=True))
            downloading = stamp(node_b, DOWNLOAD_RE, watch, a.timeout)
            node_b.wait_ready(a.timeout)
            served = stamp(node_b, re.compile(r"step \d+ params sha256"), watch, a.timeout,
                           after=DOWNLOAD_RE.search(node_b.output()).group(0))
            join_s, download_s = served - started, served - downloading
            rows["B joined"] = dict(watch.last)
            rows["peaks until B served"] = dict(watch.peak)
            joined_at = max(node_b.digests())

            def together():
                """The steps after B joined that both serve with the same bytes and that an update of a group of
                peers made (update u makes step u + 1; a step B downloaded from A, or that A made alone, is the same
                bytes too), once there are --rounds of them."""
                watch.check()
                a_d, b_d = node_a.digests(), node_b.digests()
                groups = {int(m.group(1)): int(m.group(2)) for n in nodes for m in PEERS_RE.finditer(n.output())}
                steps = [step for step in sorted(b_d) if step > joined_at and a_d.get(step) == b_d[step]
                         and groups.get(step - 1, 0) > 1]
                return steps if len(steps) >= a.rounds else None

            steps = wait_until(together, a.rounds * a.timeout, f"{a.rounds} averaged updates both nodes serve", 1.0)
            step = steps[-1]
            rows["after the updates"] = dict(watch.last)
            text = complete(node_a, a.prompt, 8)
            watch.check()
        except BaseException:
            for node in nodes:  # where each node was when the run stopped
                print(f"--- {node.name}'s last lines ---\n" + "\n".join(node.output().splitlines()[-25:]), file=sys.stderr)
            raise
        finally:
            for node in nodes:
                node.kill()
            # what was measured, also when a stage ran out of time or the memory floor stopped the nodes
            rows["peaks over the run"] = dict(watch.peak)
            print(f"{a.model_config.name}, {a.sync}: lowest MemAvailable {watch.lowest / GIB:.2f} GiB"
                  + (f" ({watch.short})" if watch.short else ""))
            print("| moment | A | B | A + B |")
            print("|---|---:|---:|---:|")
            for moment, pss in rows.items():
                pa, pb = pss.get("A", 0), pss.get("B", 0)
                print(f"| {moment} | {pa / GIB:.2f} GiB | {pb / GIB:.2f} GiB | {(pa + pb) / GIB:.2f} GiB |")
    print(f"B joined in {join_s:.0f}s ({download_s:.0f}s from its first download line to its first served step); "
          f"steps {', '.join(map(str, steps))} averaged by both, the same sha256 each; A's completion of {a.prompt!r}: "
          f"{text!r}")


if __name__ == "__main__":
    main()
