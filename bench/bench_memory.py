"""Memory a training node holds: what dtrain-node and every process under it (hivemind's DHT and averager children,
torch's shm manager) hold (`held_bytes`), once idle and once while training after 2 updates, next to the bytes of its
fp32 parameters.

A node's large tensors live in shared memory (tmpfs files in /dev/shm, and the snapshot's memfd), which the
proportional set size (PSS) misses in part: it counts the pages a process has mapped in, and a tmpfs page that no
process has touched since it was allocated (torch allocates a new shared file whole) holds memory all the same. So
the tree's memory is its PSS of private and file-backed pages (a page shared by k processes counts 1/k in each), and
each shared-memory file it maps, once, by the pages the file holds.

    .venv/bin/python bench/bench_memory.py [--configs tiny default gpt2-small gpt2-medium] [--sync per-step low-comm]
                                           [--updates 2]

--sync picks the modes measured (both by default): per-step, or low-comm (the default mode, with its sparse codec,
which holds the round's state besides).
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dtrain.node import memory  # noqa: E402
from tests.nodeproc import REPO, NodeProcess, new_run_id, wait_cpu_idle, wait_until  # noqa: E402

CONFIGS = {"tiny": REPO / "configs/tiny.json", "default": None, "gpt2-small": REPO / "configs/gpt2-small.json",
           "gpt2-medium": REPO / "configs/gpt2-medium.json"}
TEXT = Path("/work/shared/data/tinyshakespeare.txt")
GIB = 1 << 30


def tree(pid: int) -> list[int]:
    """pid and every descendant, from /proc/*/stat's parent field."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [pid], [pid]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def held_bytes(pid: int) -> int:
    """The memory the process tree under pid holds: the PSS of its private and file-backed pages, and the pages of
    every shared-memory file (/dev/shm, memfd) it maps, each file once, mapped in or not (memory.shared_files)."""
    total, files = 0, {}
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith(("Pss_Anon:", "Pss_File:")):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue  # exited between the listing and the read
        files.update(memory.shared_files(p))
    return total + sum(files.values())


def gpu_bytes_by_pid() -> dict[int, int]:
    """The GPU memory each process holds (nvidia-smi's compute apps); empty where there is no nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    held = {}
    for line in out.splitlines():
        try:
            pid, mib = (int(x) for x in line.split(","))
        except ValueError:
            continue
        held[pid] = held.get(pid, 0) + mib * (1 << 20)
    return held


def measure(name: str, sync: str, updates: int, ready_timeout_s: float, train_timeout_s: float) -> dict:
    # alone, a low-comm node makes an outer update of its own after every inner one: "updates" count in both modes
    args = ["--sync", sync, "--train-data", str(TEXT), "--local-batch-size", "2", "--local-seq-len", "64",
            "--local-samples-per-update", "2"]
    if CONFIGS[name] is not None:
        args = ["--model-config", str(CONFIGS[name]), *args]
    node = NodeProcess(f"mem-{name}-{sync}", args, new_run_id(), cold=True)
    try:
        node.wait_ready(ready_timeout_s)
        info = node.get_json("/api/v1/model/info", timeout_s=30.0)
        params = int(info["total_params"])
        idle = held_bytes(node.proc.pid)
        start = node.status()["updates"]
        wait_until(lambda: node.status()["updates"] >= start + updates, train_timeout_s, f"{updates} updates", 1.0)
        training = held_bytes(node.proc.pid)
        return dict(config=name, sync=sync, params=params, fp32=params * 4, idle=idle, training=training)
    finally:
        node.kill()
        time.sleep(2.0)


class MemoryWatch:
    """Samples MemAvailable and every node's memory (held_bytes) in a thread (`nodes` may grow meanwhile); kills
    every node when the machine runs short, and makes the nodes the OOM killer's first choice."""

    def __init__(self, nodes: list[NodeProcess], min_available_gb: float, interval_s: float = 1.0):
        self.nodes, self.min_bytes, self.interval_s = nodes, min_available_gb * GIB, interval_s
        self.lowest = math.inf  # MemAvailable, bytes
        self.peak: dict[str, int] = {}  # node name -> the most its process tree held, bytes
        self.last: dict[str, int] = {}  # node name -> what its tree held last, bytes
        self.short = ""  # set when the machine fell under the floor: every node's memory then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "MemoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    @staticmethod
    def available() -> int:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))

    @staticmethod
    def first_to_go(pid: int) -> None:
        """The node's processes are the OOM killer's first choice, before any other process on the machine."""
        for p in tree(pid):
            try:
                with open(f"/proc/{p}/oom_score_adj", "w") as f:
                    f.write("1000")
            except OSError:
                pass  # exited

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for n in list(self.nodes):
                if n.proc.poll() is None:
                    self.first_to_go(n.proc.pid)
            sizes = {n.name: held_bytes(n.proc.pid) for n in list(self.nodes) if n.proc.poll() is None}
            self.last.update(sizes)
            for name, size in sizes.items():
                self.peak[name] = max(self.peak.get(name, 0), size)
            free = self.available()
            self.lowest = min(self.lowest, free)
            if free < self.min_bytes and not self.short:
                self.short = (f"{free / GIB:.1f} GiB available, under {self.min_bytes / GIB:g}; nodes' memory: "
                              + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in sizes.items()))
                for node in list(self.nodes):
                    node.kill()

    def check(self) -> None:
        if self.short:
            raise MemoryError(f"the machine ran short of memory: {self.short}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--sync", nargs="+", default=["per-step", "low-comm"], choices=["per-step", "low-comm"])
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--train-timeout", type=float, default=1800.0)
    a = ap.parse_args()
    print("| config | sync | params | fp32 params | idle | training | training / fp32 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, sync in ((name, sync) for name in a.configs for sync in a.sync):
        r = measure(name, sync, a.updates, a.ready_timeout, a.train_timeout)
        print(f"| {r['config']} | {r['sync']} | {r['params'] / 1e6:.1f}M | {r['fp32'] / GIB:.2f} GiB | "
              f"{r['idle'] / GIB:.2f} GiB | {r['training'] / GIB:.2f} GiB | {r['training'] / r['fp32']:.1f}x |",
              flush=True)


if __name__ == "__main__":
    main()
