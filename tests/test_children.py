"""A node's forked processes die with it (node.children): a process that forks a child from its main thread, as the
node forks hivemind's DHT and averagers, and then dies by SIGKILL leaves no child behind; a child forked from another
thread outlives that thread (the kernel would tie the signal to the thread, so such children are left alone)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARENT = textwrap.dedent("""
    import multiprocessing as mp, threading, time
    from dtrain.node.children import die_with_this_process
    die_with_this_process()

    def sleep():
        time.sleep(600)

    from_main = mp.get_context("fork").Process(target=sleep)
    from_main.start()
    from_thread = []
    def fork():
        p = mp.get_context("fork").Process(target=sleep)
        p.start()
        from_thread.append(p)
    thread = threading.Thread(target=fork)
    thread.start()
    thread.join()  # the forking thread has ended
    time.sleep(0.5)
    print(from_main.pid, from_thread[0].pid, flush=True)
    time.sleep(600)
""")


def _kill(parent: subprocess.Popen, pids) -> None:
    parent.kill()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _gone_within(pids, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_forked_from_the_main_thread_die_with_a_killed_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=REPO)
    children = []
    try:
        children = [int(pid) for pid in parent.stdout.readline().split()]
        from_main, from_thread = children
        assert _alive(from_main)
        assert _alive(from_thread), "a child forked from a thread that ended was killed with the thread"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        _gone_within([from_main], 10)
        assert not _alive(from_main), "the child outlived its killed parent"
        assert _alive(from_thread)
    finally:
        _kill(parent, children)


DHT_PARENT = textwrap.dedent("""
    import time, hivemind
    from dtrain.node.children import die_with_this_process
    die_with_this_process()
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    print(dht.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_libp2p_daemon_dies_with_a_killed_node():
    """The DHT's p2pd, which hivemind starts with subprocess (no fork hooks run), ends with the node's DHT process:
    a killed node's connections close at once, and it can start again with its identity."""
    parent = subprocess.Popen([sys.executable, "-c", DHT_PARENT], stdout=subprocess.PIPE, text=True, cwd=REPO)
    daemons = []
    try:
        dht = int(parent.stdout.readline())
        children = psutil.Process(dht).children()
        daemons = [p.pid for p in children if "p2pd" in p.name()]
        assert len(daemons) == 1, [p.name() for p in children]
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        _gone_within([dht, daemons[0]], 10)
        assert not _alive(dht), "the DHT process outlived the killed node"
        assert not _alive(daemons[0]), "p2pd outlived the killed node's DHT process"
    finally:
        _kill(parent, daemons)
