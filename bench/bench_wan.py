"""The swarm behind real bandwidth limits: per-step against low-communication sync, N nodes in network namespaces.

Each node runs in a namespace of its own (tests/netns.py) with a veth to a shared bridge; with a rate R both ends of
its veth are shaped with tbf to R Mbit/s, so upload and download are each limited to R. This kernel has no netem: no
delay or loss is emulated, only bandwidth. Every node trains on its own shard of the text (no browsers); a held-out
tail of the text is never trained on. Every node waits for all N to join (--wait-for-peers N) before it trains, so
every run starts from the model's seeded weights on every node and rows at equal samples compare equal training.

Modes: per-step sync; low-comm with the dense fp16 all-reduce and parameter averaging; sparse, low-comm with
top-k payloads gathered (--wire-codec sparse). For each mode and rate it prints, from the swarm's first update after
every node is ready (the joins' downloads left out): seconds per update (outer update in low-comm mode), MB each
node sent per 1,000 samples the swarm applied, the swarm's applied samples per second, the held-out loss of node A's
served model when the run ends, the samples applied by then, and the longest time two nodes served one step with
different bytes, and the rounds a node gave up on (a commit step's abort or a failed all-reduce, summed over the
nodes' logs). A run ends after --samples applied samples or --seconds, whichever comes first; loss is comparable
only between rows that reached the same samples.

With --late-joiner the last node is not waited for: it starts once the others have made their first update, and
its row gives the seconds from its start to serving the swarm's bytes of a step (its download, catch-up and
checks) and how many updates it then made with the swarm. Its bytes and samples count from its start.

A node that dies fails the run with its exit status, the kernel's OOM line if the OOM killer ended it, and its log
tail. Every second the bench samples the machine's available memory and the memory each node's process tree holds
(bench_memory.held_bytes); the row gives the lowest available memory and the largest node, and the run stops with
every node's memory when the machine falls under --min-available-gb. The nodes' processes are the OOM killer's first
choice (oom_score_adj 1000), so a run that outgrows the machine ends one of its own nodes, not another user's
process.

With --churn (3 nodes, the default model and flags, every node with its own shard and `--local-batch-size 4
--local-seq-len 64 --local-samples-per-update 16 --target-batch-size 48`) the nodes join one after another as the swarm
trains: A founds it and trains alone, B starts once A is ready, C once B is; once C has averaged a round it is killed
and, --rejoin-after seconds later, started again with the same --identity-path. The window runs from A's first update
for --seconds, or until C is back in a round. Per joiner it prints the seconds from its start to its first averaged
round, split into its downloads (how many, their seconds), its replays and the time from ready to that round, the MB
its link received until then, and A's updates meanwhile; per rate the swarm's applied samples per second over the
window, against the unlimited run.

Runs as root (namespaces), under the heavy lock:
    flock /tmp/dtrain-heavy.lock .venv/bin/python bench/bench_wan.py --rates unlimited,20 --samples 3000
    flock /tmp/dtrain-heavy.lock .venv/bin/python bench/bench_wan.py --churn --rates unlimited,20
"""
from __future__ import annotations

import argparse
import hashlib
import math
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dtrain.node.assets import tokenizer_files  # noqa: E402
from dtrain.node.config import ModelConfig  # noqa: E402
from dtrain.node.model import build_model  # noqa: E402
from dtrain.node.tokenizer import load_tokenizer  # noqa: E402
from bench.bench_memory import GIB, MemoryWatch  # noqa: E402
from tests.netns import Net, unavailable_reason  # noqa: E402
from tests.nodeproc import TINY_CONFIG, NodeProcess, new_run_id, wait_until  # noqa: E402
from tests.swarmcheck import ByteWatch, tensor_f32  # noqa: E402
from bench.wan_churn import churn, print_churn  # noqa: E402
from bench.wan_nodes import NODE_TIMEOUTS, check_alive, status, stop_nodes  # noqa: E402

TEXT = Path("/work/shared/data/tinyshakespeare.txt")
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "dtrain" / "static" / "model_config.json"
HELD_OUT = 0.1  # the text's tail kept out of training
EVAL_BATCHES, EVAL_BATCH, EVAL_SEQ = 8, 8, 64


def shards(text: str, peers: int, folder: Path) -> tuple[list[Path], str]:
    cut = int(len(text) * (1 - HELD_OUT))
    train, held = text[:cut], text[cut:]
    size = len(train) // peers
    paths = []
    for i in range(peers):
        path = folder / f"shard{i}.txt"
        path.write_text(train[i * size:(i + 1) * size])
        paths.append(path)
    return paths, held


def tx_bytes(host) -> int:
    return int(host.run(["cat", "/sys/class/net/eth0/statistics/tx_bytes"]).stdout.strip())


def held_out_loss(node: Optional[NodeProcess], model_config: Path, held_tokens: np.ndarray) -> float:
    """The held-out loss of `node`'s served model (None: the seeded weights every run starts from)."""
    model = build_model(ModelConfig.load(model_config))
    with torch.no_grad():
        for tid, p in enumerate(model.parameters() if node is not None else ()):
            _, values = tensor_f32(node, tid)
            p.copy_(torch.from_numpy(values.copy()).view_as(p))
        model.eval()
        rng = np.random.default_rng(0)
        losses = []
        for _ in range(EVAL_BATCHES):
            starts = rng.integers(0, len(held_tokens) - EVAL_SEQ - 1, EVAL_BATCH)
            batch = torch.from_numpy(np.stack([held_tokens[s:s + EVAL_SEQ] for s in starts]).astype(np.int64))
            losses.append(model(input_ids=batch, labels=batch).loss.item())
    return float(np.mean(losses))


# mode -> its flags: per-step sync, low-comm with the dense fp16 all-reduce, low-comm with sparse payloads
MODES = {
    "per-step": ["--sync", "per-step"],
    "low-comm": ["--sync", "low-comm", "--wire-codec", "fp16"],
    "sparse": ["--sync", "low-comm", "--wire-codec", "sparse"],
}


GAVE_UP = re.compile(r"Gradient round \w+ aborted|Gradient averaging failed|Gradient round failed")


def gave_up(nodes: list[NodeProcess]) -> int:
    """Rounds the nodes gave up on, from their logs."""
    return sum(len(GAVE_UP.findall(node.output())) for node in nodes)


def polled(nodes: list[NodeProcess], fn, memory: "MemoryWatch"):
    """fn(), where fn asks the nodes over HTTP: a request that fails because the memory watch stopped the nodes
    raises MemoryError, because a node died NodeDied."""
    try:
        return fn()
    except OSError:
        memory.check()
        check_alive(nodes)
        raise


def tensor_sha256(node: NodeProcess, tensor_id: int) -> tuple[int, str]:
    """(step, sha256 of the f32 bytes) a node serves for a tensor, read in 1 MiB pieces (not held whole)."""
    def read():
        digest = hashlib.sha256()
        with urllib.request.urlopen(f"{node.url}/api/v1/model/tensor/{tensor_id}?format=f32", timeout=30) as r:
            while piece := r.read(1 << 20):
                digest.update(piece)
            return int(r.headers["X-Model-Step"]), digest.hexdigest()
    return node.in_netns(read)


def join_late(joiner: NodeProcess, nodes: list[NodeProcess], started: float, timeout_s: float,
              memory: MemoryWatch) -> float:
    """Seconds from the joiner's start until it serves, for a step, the bytes another node serves for that step:
    the status's (step, digest) polled, then the first two tensors' bytes compared (one read each, hashed as they
    come: the token embedding alone is 154 MB for GPT-2 small)."""
    everyone = [joiner, *nodes]

    def same_digest() -> bool:
        memory.check()
        mine = polled(everyone, lambda: status(joiner), memory)
        return any(s["step"] == mine["step"] and s["params_sha256"] == mine["params_sha256"]
                   for s in (polled(everyone, lambda: status(n), memory) for n in nodes))

    def same_bytes() -> bool:
        for tid in (0, 1):
            mine = polled(everyone, lambda: tensor_sha256(joiner, tid), memory)
            if not any(polled(everyone, lambda: tensor_sha256(n, tid), memory) == mine for n in nodes):
                return False
        return True

    deadline = time.monotonic() + timeout_s
    joiner.wait_ready(timeout_s)
    while True:
        wait_until(same_digest, deadline - time.monotonic(), f"{joiner.name} serving the swarm's digest", 1.0)
        took = time.monotonic() - started
        if same_bytes():  # else a node stepped between the reads: the next step's
            return took


def run(mode: str, rate, args, paths: list[Path], held_tokens: np.ndarray) -> dict:
    founders = args.peers - 1 if args.late_joiner else args.peers
    common = ["--model-config", str(args.model_config), "--local-batch-size", str(args.batch), "--local-seq-len",
              "64", *MODES[mode], "--inner-steps", str(args.inner_steps), "--topk-fraction", str(args.topk_fraction),
              *NODE_TIMEOUTS]
    run_id, nodes, join_s = new_run_id(), [], None
    with Net() as net, MemoryWatch(nodes, args.min_available_gb) as memory:
        hosts = [net.host(f"n{i}", rate_mbit=rate) for i in range(args.peers)]

        def start(i: int) -> NodeProcess:
            peers = ()
            if nodes:
                nodes[0].wait_ready(600)
                peers = [m for m in nodes[0].status()["maddrs"] if m.startswith(f"/ip4/{hosts[0].ip}/")]
            node = NodeProcess("ABCDEFGH"[i], [*common, "--wait-for-peers", str(founders), "--train-data",
                                                str(paths[i])], run_id, initial_peers=peers, netns=hosts[i],
                               host_maddrs=f"/ip4/{hosts[i].ip}/tcp/0", cold=True)
            nodes.append(node)
            return node

        try:
            for i in range(founders):
                start(i)
            for node in nodes:
                node.wait_ready(600)

            def statuses() -> list[dict]:
                memory.check()
                return [polled(nodes, lambda: status(n), memory) for n in nodes]

            def next_update() -> None:
                first = max(s["step"] for s in statuses()) + 1
                wait_until(lambda: min(s["step"] for s in statuses()) >= first, args.seconds, "a first update")

            if args.late_joiner:
                next_update()
                started = time.monotonic()
                joiner = start(founders)
                join_s = join_late(joiner, nodes[:-1], started, args.join_timeout, memory)
                print(f"{joiner.name} served the swarm's bytes {join_s:.0f}s after its start", flush=True)
            # measured from the swarm's first update after every node is ready: the joiners' catch-up downloads
            # (a join's cost, not a round's) are left out of the bytes per sample
            next_update()
            sent0 = [tx_bytes(h) for h in hosts]
            now = statuses()
            applied0, step0 = sum(s["applied_samples"] for s in now), now[0]["step"]
            began = time.monotonic()
            with ByteWatch(nodes, interval_s=0.5) as watch:
                while time.monotonic() - began < args.seconds:
                    time.sleep(2.0)
                    applied = sum(s["applied_samples"] for s in statuses()) - applied0
                    if applied >= args.samples:
                        break
            elapsed = time.monotonic() - began
            final = statuses()
            applied = sum(s["applied_samples"] for s in final) - applied0
            sent = [tx_bytes(h) - s0 for h, s0 in zip(hosts, sent0)]
            updates = final[0]["step"] - step0
            gave = gave_up(nodes)
            for node in nodes[1:]:  # their memory back before the bench builds a model of its own for the loss
                node.kill()
            loss = held_out_loss(nodes[0], args.model_config, held_tokens)
            return dict(mode=mode, rate="unlimited" if rate is None else f"{rate:g}", updates=updates,
                        gave_up=gave, join_s=join_s, joiner_updates=final[-1]["updates"],
                        s_per_update=elapsed / updates if updates else math.inf,
                        mb_per_1000=np.mean(sent) / 1e6 * 1000 / max(applied, 1), samples_per_s=applied / elapsed,
                        loss=loss, samples=applied, split_s=watch.split_s, conflicts=len(watch.conflicts),
                        lowest_available_gib=memory.lowest / GIB, largest_node_gib=max(memory.peak.values()) / GIB)
        except Exception:
            memory.check()  # the watch stopped the nodes: say so, not how a node's end was first noticed
            raise
        finally:
            stop_nodes(nodes, args.keep_logs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rates", default="unlimited,50,20,10", help="Mbit/s per link, comma-separated")
    parser.add_argument("--modes", default="per-step,low-comm,sparse", help=f"comma-separated, of {sorted(MODES)}")
    parser.add_argument("--topk-fraction", type=float, default=0.1, help="the sparse mode's top-k fraction")
    parser.add_argument("--samples", type=int, default=3000, help="applied samples that end a run")
    parser.add_argument("--seconds", type=float, default=240.0, help="longest a run trains")
    parser.add_argument("--batch", type=int, default=8, help="--local-batch-size of every node")
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--model-config", type=Path, default=None,
                        help="default: the tiny model; with --churn the node's default model")
    parser.add_argument("--churn", action="store_true",
                        help="joins one after another as the swarm trains, one node killed and started again")
    parser.add_argument("--kill-after", type=float, default=10.0, help="--churn: seconds after C's first round")
    parser.add_argument("--rejoin-after", type=float, default=60.0, help="--churn: seconds C stays away")
    parser.add_argument("--node-flags", default="", help="--churn: more dtrain-node flags for every node, in one "
                        "string (e.g. \"--inner-copy\")")
    parser.add_argument("--late-joiner", action="store_true",
                        help="the last node joins once the others have made their first update")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--join-timeout", type=float, default=1200.0,
                        help="longest the late joiner may take to serve the swarm's bytes")
    parser.add_argument("--min-available-gb", type=float, default=1.0,
                        help="stop the run when the machine's available memory falls under this")
    args = parser.parse_args()
    if unknown := set(args.modes.split(",")) - MODES.keys():
        parser.error(f"unknown modes {sorted(unknown)}; known: {sorted(MODES)}")
    if (why := unavailable_reason()) is not None:
        sys.exit(f"network namespaces unavailable: {why}")
    if args.model_config is None:
        args.model_config = DEFAULT_MODEL if args.churn else TINY_CONFIG
    text = TEXT.read_text()
    if args.churn:
        with tempfile.TemporaryDirectory() as folder:
            paths, _ = shards(text, 3, Path(folder))
            results = []
            for rate_name in args.rates.split(","):
                result = churn(None if rate_name == "unlimited" else float(rate_name), args, paths)
                results.append(result)
                print(result, flush=True)
        print_churn(results, args)
        return
    tokenizer = load_tokenizer(tokenizer_files())
    with tempfile.TemporaryDirectory() as folder:
        paths, held = shards(text, args.peers, Path(folder))
        held_tokens = np.asarray(tokenizer.encode(held).ids, dtype=np.int64)
        rows = []
        for rate_name in args.rates.split(","):
            rate = None if rate_name == "unlimited" else float(rate_name)
            for mode in args.modes.split(","):
                row = run(mode, rate, args, paths, held_tokens)
                rows.append(row)
                print(row, flush=True)
    print(f"\n{args.peers} nodes, {args.model_config.name}, batch {args.batch}, inner steps {args.inner_steps}, "
          f"sparse top-k fraction {args.topk_fraction:g}; "
          f"tbf both directions, no netem (no delay emulated); held-out loss of the seeded weights every run "
          f"starts from: {held_out_loss(None, args.model_config, held_tokens):.3f}\n")
    joiner = " | late joiner: s to the swarm's bytes | its updates" if args.late_joiner else ""
    print("| mode | Mbit/s | s/update | MB sent/node/1k samples | swarm samples/s | held-out loss | samples "
          f"| longest split (s) | rounds given up | lowest available GiB | largest node GiB{joiner} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.late_joiner else ""))
    for r in rows:
        late = f" | {r['join_s']:.0f} | {r['joiner_updates']}" if args.late_joiner else ""
        print(f"| {r['mode']} | {r['rate']} | {r['s_per_update']:.2f} | {r['mb_per_1000']:.2f} | "
              f"{r['samples_per_s']:.1f} | {r['loss']:.3f} | {r['samples']} | {r['split_s']:.1f} | "
              f"{r['gave_up']} | {r['lowest_available_gib']:.1f} | {r['largest_node_gib']:.2f}{late} |")


if __name__ == "__main__":
    main()
