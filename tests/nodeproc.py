"""Real `dtrain-node` processes on 127.0.0.1 for tests: start, read their logs and HTTP, stop them cleanly."""
from __future__ import annotations

import atexit
import contextlib
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
from typing import Callable, Optional, Sequence

from tests.forkserver import ForkServer
from tests.netns import is_shm_manager

REPO = Path(__file__).resolve().parent.parent
# the sync mode of the tests written for per-step mode; a node without --sync runs low-communication rounds
PER_STEP = ("--sync", "per-step")
TINY_CONFIG = REPO / "configs" / "tiny.json"
# Test nodes judge no contribution against a reference of their own (the default judges each against the node's own
# gradient, docs/robustness.md): most tests send synthetic gradients, random numbers that are no gradient of the
# node's data, and check exact means of them. Tests of the reference and of scoring pass `--reference-batch 4` after
# it (the last flag wins) and send real gradients.
REFERENCE_OFF = ("--reference-batch", "0")
DIGEST_RE = re.compile(r"step (\d+) params sha256 ([0-9a-f]{64})")
NORM_RE = re.compile(r"step (\d+) params l2 (\S+)")  # logged a moment after the digest
MADDR_RE = re.compile(r"^\s+(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\S+)\s*$")
LOG_DIR = REPO / "test-artifacts" / "nodes"  # every test node's log, kept for reading after passing runs too

# Nodes without a namespace or an environment of their own are forked from one interpreter that has imported the
# node's heavy libraries (tests.forkserver): a node then starts in well under a second of CPU, not ~8 s of imports.
_FORKS = ForkServer(str(REPO))
atexit.register(_FORKS.close)


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
                 env: Optional[dict] = None, netns=None, host_maddrs: str = "/ip4/127.0.0.1/tcp/0",
                 cold: bool = False):
        """`netns`: a tests.netns namespace to run in (its HTTP is reached from inside it). A node with an `env` of its
        own outside a namespace, or `cold`, starts a fresh interpreter, as an operator's does (benches measure those);
        any other is forked by the fork server (tests.forkserver)."""
        self.name = name
        self.netns = netns
        self.port = free_port()
        argv = ["--host", "127.0.0.1", "--port", str(self.port), "--host-maddrs", host_maddrs,
                "--run-id", run_id, "--matchmaking-time", "2.5", "--request-timeout", "1.0", "--averaging-timeout", "8",
                *REFERENCE_OFF]
        if initial_peers:
            argv += ["--initial-peers", *initial_peers]
        argv += list(args)
        self.lines: list[str] = []
        self._lock = threading.Lock()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{run_id}-{name}.log"
        if netns is not None and not cold:
            self.proc = _FORKS.start(argv, cwd=str(REPO), env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     netns=netns.ns)
            netns.net.adopt(self.proc)
        elif netns is not None:
            self.proc = netns.popen([sys.executable, "-m", "dtrain.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        elif env or cold:
            self.proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        else:
            self.proc = _FORKS.start(argv, cwd=str(REPO), env={**os.environ, "PYTHONUNBUFFERED": "1"})
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
        if self.netns is not None:
            return self.in_netns(self._get_json, path, timeout_s)
        return self._get_json(path, timeout_s)

    def _get_json(self, path: str, timeout_s: float):
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return json.loads(r.read())

    def in_netns(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) where this node's 127.0.0.1 is: in its namespace, if it has one."""
        if self.netns is None:
            return fn(*args, **kwargs)
        return self.netns.call(fn, *args, timeout_s=120.0, **kwargs)

    def wait_ready(self, timeout_s: float = 90.0) -> list[str]:
        """Wait for the printed join hint; returns the multiaddrs the node printed."""
        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            return "Join it from another machine with" in self.output()
        try:
            wait_until(ready, timeout_s, f"{self.name} to be ready")
        except TimeoutError:
            self.dump_stacks()
            raise TimeoutError(f"{self.name} was not ready after {timeout_s:.0f}s; its log, with the stacks of its "
                               f"threads at that moment:\n{self.output()[-12000:]}") from None
        return [m.group(1) for line in self.output().splitlines() if (m := MADDR_RE.match(line))]

    def dump_stacks(self, settle_s: float = 1.0) -> None:
        """Have the node, and its Python children (hivemind's DHT and averager processes, forked after dtrain.cli
        registered SIGUSR1 with faulthandler), write every thread's stack into its log."""
        if self.proc.poll() is None:
            for pid in (self.proc.pid, *self.children()):
                if _is_python(pid):  # not torch's shm manager, whom SIGUSR1 would end
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(settle_s)

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
        kill_node(self.proc, self.children())


NETNS_PORT = 4100  # a node in a network namespace of its own listens on it, on every address there


def kill_node(proc: subprocess.Popen, children: Sequence[int], wait_s: float = 5.0) -> None:
    """SIGKILL a node's process and `children`, except torch_shm_manager: it unlinks the node's shared-memory
    tensors (/dev/shm/torch_*) once its clients are gone, and exits by itself; killed, it leaks them."""
    for pid in children:
        if is_shm_manager(pid):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(wait_s)


def start_in(host, name: str, args: Sequence[str], run_id: str, initial_peers: Sequence[str] = ()) -> NodeProcess:
    """A node in network namespace `host` (tests.netns)."""
    return NodeProcess(name, args, run_id, initial_peers=initial_peers, netns=host,
                       host_maddrs=f"/ip4/0.0.0.0/tcp/{NETNS_PORT}")


def maddrs_on(node: NodeProcess, host) -> list[str]:
    """`node`'s addresses on the interface of namespace `host`: what a node in another namespace dials."""
    return [m for m in node.status()["maddrs"] if m.startswith(f"/ip4/{host.ip}/")]


def start_swarm(n: int, args: Sequence[str], run_id: str, ready_timeout_s: float = 90.0,
                args_of: Optional[dict[str, Sequence[str]]] = None) -> list[NodeProcess]:
    """A first node on its own, then n - 1 nodes joining it at its printed multiaddrs, all at once; returns once all
    serve. `args_of`: the arguments of a node by name ("B"), where they are not `args`."""
    args_of = args_of or {}
    nodes = [NodeProcess("A", args_of.get("A", args), run_id)]
    try:
        maddrs = nodes[0].wait_ready(ready_timeout_s)
        assert maddrs, nodes[0].output()
        for name in "BCDE"[: n - 1]:
            nodes.append(NodeProcess(name, args_of.get(name, args), run_id, initial_peers=maddrs))
        for node in nodes[1:]:
            node.wait_ready(ready_timeout_s)
    except BaseException:  # the caller gets no nodes to stop: none may outlive it
        for node in nodes:  # the stacks of every node, not only of the one that failed: the hang may be another's
            node.dump_stacks(settle_s=0.0)
        time.sleep(1.0)
        for node in nodes:
            node.kill()
        raise
    return nodes


def print_logs(nodes) -> None:
    """The nodes' logs, shown by pytest with a failing test (CI keeps the tail of its output), each ending with the
    stacks of every thread of the node and of its DHT and averager processes at that moment: what a hang was doing."""
    for node in nodes:
        node.dump_stacks(settle_s=0.0)
    time.sleep(1.0)
    for node in nodes:
        print(f"===== node {node.name} =====\n{node.output()}")


@contextlib.contextmanager
def shown_on_failure(nodes: list):
    """Kill every node in `nodes` (a list the body may still append to) when the body ends; on a failure, print
    their logs first (print_logs)."""
    try:
        yield nodes
    except BaseException:
        print_logs(nodes)
        raise
    finally:
        for node in nodes:
            node.kill()


def _is_python(pid: int) -> bool:
    try:
        return "python" in os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:  # gone, or not ours to read
        return False


def new_run_id() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, every thread (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid` to the nanosecond (/proc/PID/task/*/schedstat), where /proc/PID/stat counts
    10 ms ticks; threads that end in between are not counted."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


def wait_quiet(pid: int, window_s: float, busy_fraction: float, timeout_s: float,
               clock: Callable[[int], float] = cpu_seconds) -> tuple[float, float]:
    """Wait (bounded) until process `pid` uses under `busy_fraction` of a core over `window_s`. Returns (seconds
    waited, CPU seconds `pid` used before that quiet window)."""
    start, begun = time.monotonic(), clock(pid)
    before = begun
    while time.monotonic() - start < timeout_s:
        time.sleep(window_s)
        now = clock(pid)
        if now - before < busy_fraction * window_s:
            break
        before = now
    return time.monotonic() - start, before - begun


def wait_cpu_idle(pid: int, timeout_s: float = 60.0, busy_fraction: float = 0.05, window_s: float = 1.0) -> float:
    """Wait (bounded) until process `pid` uses under `busy_fraction` of a core over `window_s`: a node that printed
    it is ready still loads its serving weights for a while, which a benchmark must not time. Returns seconds."""
    return wait_quiet(pid, window_s, busy_fraction, timeout_s)[0]
