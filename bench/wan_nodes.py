"""The node processes of a bench_wan.py run (tests.nodeproc's NodeProcess in a namespace): the timeouts they are
started with, their status read, a node's exit noticed (with the kernel's line when the OOM killer ended it), and
every node stopped. The bench's per-mode runs and its churn runs (wan_churn.py) share them.
"""
from __future__ import annotations

import subprocess
import time

from tests.nodeproc import NodeProcess

NODE_TIMEOUTS = ["--matchmaking-time", "5", "--request-timeout", "3", "--averaging-timeout", "30"]  # the defaults


class NodeDied(RuntimeError):
    """A node of the run exited."""


def killed_by_oom(pid: int) -> str:
    """The kernel's line if its OOM killer ended `pid`, else ""."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return next((line.strip() for line in log.splitlines() if f"Killed process {pid} " in line), "")


def check_alive(nodes: list[NodeProcess], settle_s: float = 3.0) -> None:
    """NodeDied, with the node's exit status and log tail, if one of `nodes` has exited (or exits within
    `settle_s`: a refused connection can come before the process is reaped)."""
    deadline = time.monotonic() + settle_s
    while True:
        for node in nodes:
            if node.proc.poll() is not None:
                oom = killed_by_oom(node.proc.pid)
                raise NodeDied(f"{node.name} exited with {node.proc.returncode}" + (f" ({oom})" if oom else "")
                               + f"; its log ends:\n{node.output()[-6000:]}")
        if time.monotonic() >= deadline:
            return
        time.sleep(0.5)


STATUS_TIMEOUT_S = 60.0  # a node in its outer step on a loaded machine answered later than 5 s (GPT-2 small)


def status(node: NodeProcess) -> dict:
    return node.get_json("/api/v1/swarm/status", timeout_s=STATUS_TIMEOUT_S)


def stop_nodes(nodes, keep_logs: bool) -> None:
    """Every node of a run killed; with --keep-logs, where each one's log is."""
    for node in nodes:
        node.kill()
    if keep_logs:
        for node in nodes:
            print(f"--- {node.name}: {node.log_path}")
