"""The processes a node forks die with it.

hivemind runs the DHT and each averager in a forked process. When the node's own process ends without shutting them
down (killed, or crashed), they live on as orphans: a DHT that still answers for a node that is gone, averagers that
wait for a host that no longer answers, and the p2pd of each holding its ports. `die_with_this_process` makes every
process forked from the main thread afterwards ask the kernel for SIGKILL when its parent exits (Linux
PR_SET_PDEATHSIG). The kernel ties that signal to the thread that forked, so forks from any other thread, whose
children must outlive it, are left as they are.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
_parent = {"pid": None, "main": False}  # written in the parent just before each fork, read by the child after it
_installed = False


def _before_fork() -> None:
    _parent["pid"] = os.getpid()
    _parent["main"] = threading.current_thread() is threading.main_thread()


def _in_child() -> None:
    if not _parent["main"]:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not Linux: the child lives as it would have
    if os.getppid() != _parent["pid"]:  # the parent ended before the request was made: nobody will signal
        os._exit(1)


def die_with_this_process() -> None:
    """Idempotent. Linux only (elsewhere it does nothing)."""
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)
    _installed = True
