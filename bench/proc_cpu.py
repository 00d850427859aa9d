"""CPU time from /proc: of processes, of a process's busiest thread, and of the whole machine.

bench_hardware.py reads these before and after a timed window, so that each row says what the measured processes
used and how busy every other process on the machine was meanwhile.
"""
from __future__ import annotations

import os
from typing import Optional


def cpu_seconds(pids) -> float:
    """User + system CPU time of these processes, every thread (/proc/PID/stat); gone ones count 0."""
    return sum(cpu_seconds_of(f"/proc/{pid}/stat") for pid in pids)


def cpu_seconds_of(stat_path: str) -> float:
    """User + system CPU time in a /proc stat file (a process's, or a thread's under task/); 0 when gone."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def busiest_thread_seconds(pid: int, before: Optional[dict] = None) -> tuple[float, dict]:
    """(CPU seconds since `before` of the thread of `pid` that used the most, every thread's CPU seconds now): of a
    node, its training thread."""
    try:
        now = {tid: cpu_seconds_of(f"/proc/{pid}/task/{tid}/stat") for tid in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        now = {}
    return max((now[t] - (before or {}).get(t, 0.0) for t in now), default=0.0), now


def machine_cpu_seconds() -> float:
    """CPU seconds every core of this machine spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
