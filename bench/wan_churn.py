"""bench_wan.py --churn: nodes join one after another as the swarm trains, one leaves and comes back.

Three nodes, each in a namespace of its own behind tbf (tests/netns.py), the default model and flags but for
`CHURN_FLAGS`: A founds the swarm and trains alone, B starts once A is ready, C once B is; once C has averaged a round
it is killed and, --rejoin-after seconds later, started again with the same --identity-path. What each joiner took
(its downloads, replays, the time from ready to its first averaged round, the bytes its link received) is read from
the nodes' logs and the hosts' counters, and printed as two markdown tables.
"""
from __future__ import annotations

import contextlib
import re
import shlex
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Optional

from bench.wan_nodes import NODE_TIMEOUTS, check_alive, status, stop_nodes
from tests.netns import Net
from tests.nodeproc import NodeProcess, new_run_id, wait_until
from tests.sampler import Sampler

STAMP = re.compile(r"^(\w{3} +\d+ \d\d:\d\d:\d\d\.\d{3}) ")
HIVEMIND_DOWNLOAD = re.compile(r"Downloaded the state from \S+ in ([\d.]+)s")
RANGES_DOWNLOAD = re.compile(r"Downloaded the state of epoch \d+ in ranges from \d+ donors in ([\d.]+)s")
REPLAY = re.compile(r"Caught up from epoch \d+ to \d+ by replaying \d+ rounds from \S+: [\d.]+ MB in ([\d.]+)s")
FIRST_ROUND = re.compile(r"Averaged gradients with ([2-9]|\d\d+) peers")
UPDATE_LINE = re.compile(r"\] update \d+: ")
# the flags of the churn runs, as a new user starts a node (the model and every other flag at their defaults)
CHURN_FLAGS = ["--local-batch-size", "4", "--local-seq-len", "64", "--local-samples-per-update", "16",
               "--target-batch-size", "48", *NODE_TIMEOUTS]


def stamp_of(line: str) -> Optional[float]:
    """A log line's time (the nodes log local time without a year), as time.time() counts it."""
    m = STAMP.match(line)
    if m is None:
        return None
    year = time.localtime().tm_year
    return time.mktime(time.strptime(f"{year} {m.group(1).split('.')[0]}", "%Y %b %d %H:%M:%S")) + \
        float("0." + m.group(1).split(".")[1])


def lines_between(output: str, pattern: re.Pattern, start: float, end: float) -> list[re.Match]:
    found = []
    for line in output.splitlines():
        if (m := pattern.search(line)) and (t := stamp_of(line)) is not None and start <= t <= end:
            found.append(m)
    return found


def first_stamp(output: str, pattern: re.Pattern, after: float = 0.0) -> Optional[float]:
    for line in output.splitlines():
        if pattern.search(line) and (t := stamp_of(line)) is not None and t >= after:
            return t
    return None


def rx_bytes(host) -> int:
    """Bytes `host` has received on its link."""
    return int(host.run(["cat", "/sys/class/net/eth0/statistics/rx_bytes"]).stdout.strip())


def churn(rate, args, paths: list[Path]) -> dict:
    """One churn run at `rate` Mbit/s per link (None: unlimited): A founds the swarm and trains alone; B joins once A
    is ready, C once B is; once C has averaged a round, C is killed and started again --rejoin-after s later with the
    same --identity-path. The window runs from A's first update to --seconds after it."""
    run_id, nodes, joins = new_run_id(), [], []
    flags = ["--model-config", str(args.model_config), *CHURN_FLAGS, *shlex.split(args.node_flags)]
    with Net() as net, tempfile.TemporaryDirectory() as folder:
        hosts = [net.host(f"n{i}", rate_mbit=rate) for i in range(3)]
        identity = [str(Path(folder) / f"node{i}.identity") for i in range(3)]
        applied: dict[str, int] = {}  # a node process's name -> its last applied_samples seen

        def start(i: int, name: str) -> NodeProcess:
            peers = [m for m in status(nodes[0])["maddrs"] if m.startswith(f"/ip4/{hosts[0].ip}/")] if nodes else ()
            node = NodeProcess(name, [*flags, "--train-data", str(paths[i]), "--identity-path", identity[i]], run_id,
                               initial_peers=peers, netns=hosts[i], host_maddrs=f"/ip4/{hosts[i].ip}/tcp/0",
                               cold=True)
            node.started, node.host = time.time(), hosts[i]
            nodes.append(node)
            return node

        def poll() -> None:
            for node in nodes:
                if node.proc.poll() is None:
                    try:
                        applied[node.name] = max(applied.get(node.name, 0), int(status(node)["applied_samples"]))
                    except (OSError, ValueError, KeyError):
                        pass

        def joined(node: NodeProcess, timeout_s: float) -> None:
            """Until the node averaged a round with the others (its first), polling everyone meanwhile."""
            deadline = time.monotonic() + timeout_s
            while first_stamp(node.output(), FIRST_ROUND, node.started) is None:
                check_alive([n for n in nodes if n.name != "C" or n is node])
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{node.name} averaged no round within {timeout_s:.0f}s")
                poll()
                time.sleep(2.0)

        try:
            a = start(0, "A")
            a.wait_ready(600)
            wait_until(lambda: status(a)["updates"] >= 1, 300, "A's first update", 1.0)
            poll()
            window_start, base = time.time(), sum(applied.values())
            with contextlib.ExitStack() as stack:  # each host's received bytes, every second
                rx = {h.ns: stack.enter_context(Sampler(partial(rx_bytes, h), 1.0)) for h in hosts}
                b = start(1, "B")
                joins.append(b)
                b.wait_ready(args.join_timeout)
                c = start(2, "C")
                joins.append(c)
                joined(b, args.join_timeout)
                joined(c, args.join_timeout)
                time.sleep(args.kill_after)
                c.kill()
                left = time.time()
                while time.time() < left + args.rejoin_after:
                    poll()
                    time.sleep(2.0)
                c2 = start(2, "C2")
                joins.append(c2)
                joined(c2, args.join_timeout)
                while time.time() < window_start + args.seconds:
                    poll()
                    time.sleep(2.0)
                poll()
                elapsed = time.time() - window_start
                samples = sum(applied.values()) - base
                a_out = a.output()
                rows = []
                for node in joins:
                    out = node.output()
                    first = first_stamp(out, FIRST_ROUND, node.started)
                    end = first if first is not None else time.time()
                    downloads = [float(m.group(1)) for m in lines_between(out, HIVEMIND_DOWNLOAD, node.started, end)]
                    downloads += [float(m.group(1)) for m in lines_between(out, RANGES_DOWNLOAD, node.started, end)]
                    replays = [float(m.group(1)) for m in lines_between(out, REPLAY, node.started, end)]
                    ready = first_stamp(out, re.compile(r"Node ready at step"), node.started) or end
                    rows.append(dict(node=node.name, join_s=end - node.started, downloads=len(downloads),
                                     download_s=sum(downloads), replay_s=sum(replays), ready_s=ready - node.started,
                                     first_round_s=end - ready,
                                     state_mb=rx[node.host.ns].increase(node.started, end) / 1e6,
                                     founder_updates=len(lines_between(a_out, UPDATE_LINE, node.started, end))))
            a_gave_up = len(lines_between(a_out, re.compile(r"could not find a group"), window_start, time.time()))
            return dict(rate="unlimited" if rate is None else f"{rate:g}", samples_per_s=samples / elapsed,
                        samples=samples, seconds=elapsed, joins=rows, a_gave_up=a_gave_up,
                        a_updates=len(lines_between(a_out, UPDATE_LINE, window_start, time.time())))
        finally:
            stop_nodes(nodes, args.keep_logs)


def print_churn(results: list[dict], args) -> None:
    extra = f" {args.node_flags}" if args.node_flags else ""
    print(f"\nchurn: 3 nodes, {args.model_config.name}, default flags and {' '.join(CHURN_FLAGS[:8])}{extra}; A founds, B "
          f"joins once A is ready, C once B is; C is killed {args.kill_after:g}s after its first round and started "
          f"again {args.rejoin_after:g}s later with the same identity; tbf both ways on every link\n")
    base = next((r["samples_per_s"] for r in results if r["rate"] == "unlimited"), None)
    print("| Mbit/s | node | join s | downloads | download s | replay s | ready s | ready to first round s "
          "| MB received until then | A's updates meanwhile |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for j in r["joins"]:
            print(f"| {r['rate']} | {j['node']} | {j['join_s']:.0f} | {j['downloads']} | {j['download_s']:.0f} | "
                  f"{j['replay_s']:.1f} | {j['ready_s']:.0f} | {j['first_round_s']:.0f} | {j['state_mb']:.0f} | "
                  f"{j['founder_updates']} |")
    print("\n| Mbit/s | window s | swarm samples | samples/s | vs unlimited | A's updates | A's rounds without a group |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        vs = f"{r['samples_per_s'] / base:.2f}x" if base else ""
        print(f"| {r['rate']} | {r['seconds']:.0f} | {r['samples']} | {r['samples_per_s']:.2f} | {vs} | "
              f"{r['a_updates']} | {r['a_gave_up']} |")
