"""The `dtrain-node` processes bench_hardware.py times, and its progress lines.

A `Node` is one `python -m dtrain.cli` process of this tree (PYTHONPATH set to it) on 127.0.0.1: its output is kept
with the time each line came and written to a log file, its status read over HTTP, and it is stopped with SIGTERM,
then SIGKILL for it and its children. `wait_for` polls a condition while every node is checked to be alive; a node
that exits, or a wait that runs out, raises `NodeFailed`. `say` writes the bench's progress to stderr, stamped with
the seconds since this module was imported (the bench imports it last, once its own imports are done).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench.bench_memory import tree
from tests.nodeproc import free_port, kill_node

REPO = Path(__file__).resolve().parent.parent
JOIN_HINT = "Join it from another machine with"
MADDR_RE = re.compile(r"^\s+(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\S+)\s*$")
T_START = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T_START:6.0f}s] {msg}", file=sys.stderr, flush=True)


class NodeFailed(RuntimeError):
    """A node of the run exited, did not answer, or a wait on the nodes ran out; the message says which."""


class Node:
    """One `python -m dtrain.cli` process of this tree; its output is kept, with the time each line came."""

    def __init__(self, name: str, args: list[str], run_id: str, workdir: Path, initial_peers: tuple = ()):
        self.name, self.port = name, free_port()
        argv = [sys.executable, "-m", "dtrain.cli", "--host", "127.0.0.1", "--port", str(self.port),
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", run_id, *args]
        if initial_peers:
            argv += ["--initial-peers", *initial_peers]
        self.argv = argv
        path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.log_path = workdir / f"{run_id}-{name}.log"
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                with self._lock:
                    self.lines.append((time.monotonic(), line.rstrip("\n")))

    def output(self, since: float = 0.0, until: float = float("inf")) -> list[str]:
        with self._lock:
            return [line for t, line in self.lines if since <= t <= until]

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.output()[-n:])

    def alive(self) -> None:
        if self.proc.poll() is not None:
            time.sleep(0.5)  # the reader takes its last lines
            raise NodeFailed(f"node {self.name} exited with {self.proc.returncode}")

    def status(self, timeout_s: float = 10.0) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/swarm/status", timeout=timeout_s) as r:
            return json.loads(r.read())

    def trained(self) -> tuple[int, float, dict]:
        """(applied + pending samples, when, the status): the smaller of two reads 0.1 s apart. The bridge reads the
        training thread's counters without a lock, and an update moves its samples from pending to applied in two
        statements: a read between them counts them twice, and the next read is then smaller."""
        reads = []
        for _ in range(2):
            s = self.status()
            reads.append((s["applied_samples"] + s["pending_samples"], time.monotonic(), s))
            time.sleep(0.1)
        return min(reads, key=lambda r: r[0])

    def wait_ready(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while not any(JOIN_HINT in line for line in self.output()):
            self.alive()
            if time.monotonic() > deadline:
                raise NodeFailed(f"node {self.name} printed no join hint in {timeout_s:.0f}s")
            time.sleep(0.2)
        while True:  # the bridge listens right after the hint
            try:
                self.status()
                break
            except OSError:
                self.alive()
                if time.monotonic() > deadline:
                    raise NodeFailed(f"node {self.name}'s status did not answer in {timeout_s:.0f}s")
                time.sleep(0.2)
        return [m.group(1) for line in self.output() if (m := MADDR_RE.match(line))]

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then (if it hangs) SIGKILL for it and its children, except torch's shm manager, which unlinks
        the node's shared memory once its clients are gone and exits by itself."""
        self.terminate()
        try:
            self.proc.wait(max(timeout_s, 0.1))
            return
        except subprocess.TimeoutExpired:
            say(f"node {self.name} ignored SIGTERM: killing it and its children")
        kill_node(self.proc, list(reversed(tree(self.proc.pid)[1:])), wait_s=10)


def wait_for(what: str, predicate, nodes: list[Node], timeout_s: float, interval_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while True:
        for node in nodes:
            node.alive()
        try:
            value = predicate()
        except OSError as e:  # a status read that timed out on a busy machine: asked again
            say(f"  (status read failed: {e}; trying again)")
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise NodeFailed(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
