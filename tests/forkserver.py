"""Test nodes forked from one interpreter that has already imported the node's heavy libraries.

Importing torch, transformers, scipy and tenseal costs a `dtrain-node` about 8 CPU seconds before it reads its
arguments, and the suite starts over a hundred nodes: on two cores, that was minutes of the other tests' time. The
fork server imports those libraries once per test worker and forks a node from itself on request; the child then
imports dtrain.cli (and hivemind) and runs `dtrain.cli.main(argv)` as `python -m dtrain.cli ARGV` would, with the
request's cwd and environment, its stdout and stderr on the caller's pipe.

What the child must not inherit stays out of the server: hivemind, whose module-level multiprocessing locks
(MPFuture's) would otherwise be one lock shared by every node of the worker, is imported by each node itself. The
server has one thread when it forks (a fork copies only the calling thread; it checks), and each node reseeds numpy's
and torch's global generators, as a fresh interpreter would have them (Python's own `random` reseeds at fork).

Protocol, over a SOCK_SEQPACKET socket pair: the caller sends a JSON request {argv, cwd, env, netns} with two
descriptors, the write ends of the node's output pipe and of a status pipe; the server answers with the node's pid and
a pidfd of it, and once it has reaped the node writes its exit code (as subprocess reports it: -N for a signal) on the
status pipe. A node given a network namespace enters it (setns) before anything else.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Optional, Sequence

# imported by the server before it forks: third-party, thread-free after import, no process-shared state
PRELOAD = ("torch", "numpy", "scipy.optimize", "sympy", "aiohttp.web", "uvloop", "safetensors.torch", "tenseal",
           "transformers.modeling_utils", "transformers.models.gpt2.modeling_gpt2")
NOT_PRELOADED = ("hivemind",)
MAX_REQUEST = 1 << 20


def serve(fd: int) -> None:
    """The server's loop: fork a node per request, report each node's exit; ends when the caller closes its end."""
    import dtrain  # noqa: F401  its environment defaults (OPENBLAS_NUM_THREADS) come before numpy, as in a node
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    leaked = [m for m in NOT_PRELOADED if m in sys.modules]
    assert not leaked, f"the fork server imported {leaked}, which each node must import for itself"
    assert len(os.listdir("/proc/self/task")) == 1, "the fork server has threads: a fork would copy only one"
    sock = socket.socket(fileno=fd)
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, status write end)
    while True:
        ready, _, _ = select.select([sock, *children], [], [])
        for r in ready:
            if r is sock:
                message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 2)
                if not message:
                    return  # the test process closed its end, or ended; its nodes are its to stop
                out_fd, status_fd = fds
                pid = os.fork()
                if pid == 0:
                    sock.close()
                    _become_node(json.loads(message), out_fd,
                                 [status_fd, *children, *(s for _, s in children.values())])
                os.close(out_fd)
                pidfd = os.pidfd_open(pid)  # opened before this loop can reap the node: it is the node's
                children[pidfd] = (pid, status_fd)
                socket.send_fds(sock, [str(pid).encode()], [pidfd])
            else:
                pid, status_fd = children.pop(r)
                _, status = os.waitpid(pid, 0)
                os.write(status_fd, str(os.waitstatus_to_exitcode(status)).encode())
                os.close(status_fd)
                os.close(r)


def _become_node(request: dict, out_fd: int, server_fds: Sequence[int]) -> None:
    """In the forked child: the node, as `python -m dtrain.cli` with the request's argv, cwd and environment."""
    for fd in server_fds:
        os.close(fd)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    if request["netns"] is not None:
        from tests.netns import enter
        enter(request["netns"])  # before the node opens a socket: its sockets live in the namespace
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import numpy
    import torch
    numpy.random.seed()
    torch.seed()
    import dtrain.cli
    sys.argv = ["dtrain-node", *request["argv"]]
    dtrain.cli.main(request["argv"])
    sys.exit(0)  # main ends the process itself; this only keeps the server's loop from running in the node


class ForkedNode:
    """What the test harness uses of subprocess.Popen, for a node the fork server started."""

    def __init__(self, pid: int, pidfd: int, stdout, status_fd: int, args: Sequence[str]):
        self.pid = pid
        self.stdout = stdout
        self.args = list(args)
        self.returncode: Optional[int] = None
        self._pidfd = pidfd  # signals sent through it reach this node, never a later process given its pid
        self._status = status_fd
        self._lock = threading.Lock()

    def poll(self) -> Optional[int]:
        return self._collect(0)

    def wait(self, timeout: Optional[float] = None) -> int:
        if self._collect(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _collect(self, timeout: Optional[float]) -> Optional[int]:
        with self._lock:
            if self.returncode is None and select.select([self._status], [], [], timeout)[0]:
                data = os.read(self._status, 32)
                if not data:  # the server ended before the node: nobody can tell how the node ends
                    raise RuntimeError(f"the fork server of node {self.pid} ended before the node")
                os.close(self._status)
                os.close(self._pidfd)
                self.returncode = int(data)
            return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:
                    pass  # exited; its status is on the way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One fork server per test process, started on first use."""

    def __init__(self, repo: str):
        self._repo = repo
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._server: Optional[subprocess.Popen] = None

    def start(self, argv: Sequence[str], cwd: str, env: dict, netns: Optional[str] = None) -> ForkedNode:
        """A node forked with `argv`, `cwd` and `env`; in network namespace `netns` (its name) if given."""
        out_r, out_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                sock = self._connected()
                socket.send_fds(sock, [json.dumps(dict(argv=list(argv), cwd=cwd, env=env, netns=netns)).encode()],
                                [out_w, status_w])
                reply, fds, _, _ = socket.recv_fds(sock, 32, 1)
                if not reply:
                    raise RuntimeError("the test nodes' fork server exited; its error is in the test's stderr")
        except BaseException:
            os.close(out_r)
            os.close(status_r)
            raise
        finally:
            os.close(out_w)
            os.close(status_w)
        return ForkedNode(int(reply), fds[0], os.fdopen(out_r, "r", encoding="utf-8", errors="replace"), status_r,
                          argv)

    def _connected(self) -> socket.socket:
        if self._server is not None and self._server.poll() is None:
            return self._sock
        if self._sock is not None:
            self._sock.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._server = subprocess.Popen([sys.executable, "-m", "tests.forkserver", str(theirs.fileno())],
                                            cwd=self._repo, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._sock = ours
        return ours

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()  # the server ends on end of file
                self._sock = None
            if self._server is not None:
                try:
                    self._server.wait(10)
                except subprocess.TimeoutExpired:
                    self._server.kill()
                    self._server.wait(5)
                self._server = None


if __name__ == "__main__":
    serve(int(sys.argv[1]))
