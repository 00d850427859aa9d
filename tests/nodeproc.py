"""Real `dtrain-node` processes on 127.0.0.1 for tests: start, read their logs and HTTP, stop them cleanly."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "configs" / "tiny.json"
DIGEST_RE = re.compile(r"step (\d+) params sha256 ([0-9a-f]{64})")
NORM_RE = re.compile(r"step (\d+) params sha256 [0-9a-f]{64} l2 (\S+)")
MADDR_RE = re.compile(r"^\s+(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\S+)\s*$")
LOG_DIR = REPO / "test-artifacts" / "nodes"  # every test node's log, kept for reading after passing runs too


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


class NodeProcess:
    """One dtrain-node subprocess; its output is collected line by line in a background thread."""

    def __init__(self, name: str, args: Sequence[str], run_id: str, initial_peers: Sequence[str] = (),
                 env: Optional[dict] = None):
        self.name = name
        self.port = free_port()
        cmd = [sys.executable, "-m", "dtrain.cli", "--host", "127.0.0.1", "--port", str(self.port),
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", run_id,
               "--matchmaking-time", "2.5", "--request-timeout", "1.0", "--averaging-timeout", "8"]
        if initial_peers:
            cmd += ["--initial-peers", *initial_peers]
        cmd += list(args)
        self.lines: list[str] = []
        self._lock = threading.Lock()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{run_id}-{name}.log"
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                with self._lock:
                    self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get_json(self, path: str, timeout_s: float = 5.0):
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout_s: float = 90.0) -> list[str]:
        """Wait for the printed join hint; returns the multiaddrs the node printed."""
        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            return "Join it from another machine with" in self.output()
        wait_until(ready, timeout_s, f"{self.name} to be ready")
        return [m.group(1) for line in self.output().splitlines() if (m := MADDR_RE.match(line))]

    def digests(self) -> dict[int, str]:
        """step -> params sha256, from the node's log of every published snapshot."""
        return {int(m.group(1)): m.group(2) for m in DIGEST_RE.finditer(self.output())}

    def norms(self) -> dict[int, float]:
        """step -> L2 norm of all parameters, from the same log lines."""
        return {int(m.group(1)): float(m.group(2)) for m in NORM_RE.finditer(self.output())}

    def status(self) -> dict:
        return self.get_json("/api/v1/swarm/status")

    def children(self) -> list[int]:
        try:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
            return [int(x) for x in out.stdout.split()]
        except OSError:
            return []

    def terminate(self, timeout_s: float = 15.0) -> float:
        """SIGTERM; returns seconds until exit. Kills (and fails loudly later) only if it hangs."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise TimeoutError(f"{self.name} ignored SIGTERM for {timeout_s}s:\n{self.output()[-3000:]}")
        return time.monotonic() - start

    def kill(self):
        """SIGKILL the node and its children, except torch_shm_manager: it unlinks the node's shared-memory
        tensors (/dev/shm/torch_*) once its clients are gone, and exits by itself; killed, it leaks them."""
        for pid in self.children():
            if _comm(pid) == "torch_shm_manag":  # /proc comm: the first 15 characters
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def start_swarm(n: int, args: Sequence[str], run_id: str, ready_timeout_s: float = 90.0) -> list[NodeProcess]:
    """A first node on its own, then n - 1 nodes joining it at its printed multiaddrs; returns once all serve."""
    nodes = [NodeProcess("A", args, run_id)]
    maddrs = nodes[0].wait_ready(ready_timeout_s)
    assert maddrs, nodes[0].output()
    for name in "BCDE"[: n - 1]:
        nodes.append(NodeProcess(name, args, run_id, initial_peers=maddrs))
    for node in nodes[1:]:
        node.wait_ready(ready_timeout_s)
    return nodes


def print_logs(nodes) -> None:
    """The nodes' logs, shown by pytest with a failing test (CI keeps the tail of its output)."""
    for node in nodes:
        print(f"===== node {node.name} =====\n{node.output()}")


def new_run_id() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
