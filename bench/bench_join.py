"""Time to join a sparse low-communication swarm behind bandwidth limits: the state downloaded from one peer through
hivemind, or in ranges from 1 or 2 donors at once (--state-donors, node.lowcomm.statefetch).

Two donors, A and B, each in a network namespace whose link is shaped to --donor-mbit both ways (tbf, tests/netns.py:
a home uplink); they hold the same state and do not train, so every joiner downloads the same bytes and the time
is the transfer's. Each joiner is a fresh node in a namespace of its own, built with another seed (a joiner that
built the swarm's start itself takes no download), its link shaped to each of --joiner-mbit (unlimited: a home
downlink well above the donors' uplinks). A row's time runs from the joiner's first download line in its log to the
first step it serves (the download, its checks and the first snapshot); a joiner is killed after its row, and the
next one starts once its records have expired. This kernel has no netem: no delay or loss is emulated, only
bandwidth.

Runs as root (namespaces), under the heavy lock:
    flock /tmp/dtrain-heavy.lock .venv/bin/python bench/bench_join.py --model-config dtrain/static/model_config.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.netns import Net, unavailable_reason  # noqa: E402
from tests.nodeproc import TINY_CONFIG, NodeProcess, new_run_id, wait_until  # noqa: E402

NODE_TIMEOUTS = ["--matchmaking-time", "5", "--request-timeout", "3", "--averaging-timeout", "30"]  # the defaults
STAMP = re.compile(r"^(\w{3} \d+ \d\d:\d\d:\d\d\.\d{3}) ")
BEGIN = re.compile(r"Downloading \d+ ranges of the state|Loading the swarm's parameters and optimizer state")
SERVED = re.compile(r"step \d+ params sha256")
RECORDS_EXPIRE_S = 25.0  # a killed joiner's DHT records (20 s) are gone before the next one looks for donors
WAYS = {"hivemind": 0, "ranges-1": 1, "ranges-2": 2}  # --state-donors of the joiner
LABELS = {"hivemind": "one peer (hivemind)", "ranges-1": "ranges, 1 donor", "ranges-2": "ranges, 2 donors"}


def stamp_of(output: str, pattern: re.Pattern) -> float:
    for line in output.splitlines():
        if pattern.search(line) and (m := STAMP.match(line)):
            return datetime.strptime(f"2000 {m.group(1)}", "%Y %b %d %H:%M:%S.%f").timestamp()
    raise ValueError(f"no line matches {pattern.pattern!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-config", type=Path, default=TINY_CONFIG)
    parser.add_argument("--donor-mbit", type=float, default=20.0)
    parser.add_argument("--joiner-mbit", default="unlimited,20", help="Mbit/s of the joiner's link, comma-separated")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {list(WAYS)}")
    args = parser.parse_args()
    if (why := unavailable_reason()) is not None:
        sys.exit(f"network namespaces unavailable: {why}")
    model = ["--model-config", str(args.model_config)]
    common = [*model, "--state-donors", "2", *NODE_TIMEOUTS]  # the donors serve ranges
    rows = []
    config = json.loads(args.model_config.read_text())
    other_seed = Path(tempfile.mkdtemp(prefix="bench-join-")) / args.model_config.name
    other_seed.write_text(json.dumps({**config, "seed": config.get("seed", 1234) + 1}))
    with Net() as net:
        a_host, b_host = (net.host(n, rate_mbit=args.donor_mbit) for n in ("a", "b"))
        run_id, donors = new_run_id(), []
        try:
            donors.append(NodeProcess("A", common, run_id, netns=a_host, host_maddrs=f"/ip4/{a_host.ip}/tcp/0",
                                      cold=True))
            donors[0].wait_ready(600)
            peers = [m for m in donors[0].status()["maddrs"] if m.startswith(f"/ip4/{a_host.ip}/")]
            donors.append(NodeProcess("B", common, run_id, initial_peers=peers, netns=b_host,
                                      host_maddrs=f"/ip4/{b_host.ip}/tcp/0", cold=True))
            donors[1].wait_ready(900)
            digest = donors[0].status()["params_sha256"]
            wait_until(lambda: donors[1].status()["params_sha256"] == digest, 60, "B to serve A's bytes")
            for i, (rate_name, way) in enumerate((r, w) for r in args.joiner_mbit.split(",")
                                                 for w in args.ways.split(",")):
                rate = None if rate_name == "unlimited" else float(rate_name)
                host = net.host(f"j{i}", rate_mbit=rate)
                argv = ["--model-config", str(other_seed), "--state-donors", str(WAYS[way]), *NODE_TIMEOUTS]
                joiner = NodeProcess(f"J{i}", argv, run_id, initial_peers=peers, netns=host,
                                     host_maddrs=f"/ip4/{host.ip}/tcp/0", cold=True)
                try:
                    joiner.wait_ready(900)
                    out = joiner.output()
                    took = stamp_of(out, SERVED) - stamp_of(out, BEGIN)
                    ok = joiner.status()["params_sha256"] == digest
                    row = dict(way=way, joiner=rate_name, seconds=took, same_bytes=ok,
                               fell_back=WAYS[way] > 0 and "Loading the swarm's parameters" in out)
                finally:
                    joiner.kill()
                rows.append(row)
                print(row, flush=True)
                time.sleep(RECORDS_EXPIRE_S)
        finally:
            for node in donors:
                node.kill()
    print(f"\n{args.model_config.name}, two donors each behind {args.donor_mbit:g} Mbit/s (tbf both directions, "
          f"no delay emulated), an idle swarm\n")
    print("| download | joiner's link, Mbit/s | seconds to join | vs one peer | the swarm's bytes |")
    print("|---|---|---|---|---|")
    for r in rows:
        base = next((b["seconds"] for b in rows if b["joiner"] == r["joiner"] and WAYS[b["way"]] == 0), None)
        vs = f"{base / r['seconds']:.2f}x" if base else ""
        label = LABELS[r["way"]] + (" (fell back)" if r["fell_back"] else "")
        print(f"| {label} | {r['joiner']} | {r['seconds']:.1f} | {vs} | {'yes' if r['same_bytes'] else 'no'} |")


if __name__ == "__main__":
    main()
