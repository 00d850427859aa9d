"""A node in the test's own process: `dtrain.cli.build` from the same flags a `dtrain-node` takes, its app served
by aiohttp on 127.0.0.1 from a thread with an event loop of its own, real HTTP on a real port.

It answers what `tests.nodeproc.NodeProcess` answers (`url`, `port`, `get_json`, `status`, `output`, `kill`), so a
conformance test reads the same against either; it starts in a second or two instead of a process's ten, because
torch, transformers and hivemind are imported once for the whole test run. The node is a real hivemind peer alone
in its swarm (its DHT and averagers are processes of their own, as in `dtrain-node`). Tests of what a separate
process does (exit codes, signals, several peers) use `NodeProcess`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import urllib.request
from typing import Sequence

from aiohttp import web

from dtrain.cli import build
from dtrain.flags import parse_config
from tests.nodeproc import REFERENCE_OFF

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


class _Lines(logging.Handler):
    """Every log line of this process while the node lives (in-process nodes share the root logger)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock:
            self.lines.append(record.getMessage())

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.lines)


async def _shut_down(runner: web.AppRunner) -> None:
    """The app's cleanup, then whatever its handlers left running on the loop, cancelled and awaited."""
    await runner.cleanup()
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


class InProcessNode:
    """A node built from `dtrain-node` flags in this process; call from the main thread (hivemind's averagers
    install signal handlers), and `kill()` it when done."""

    def __init__(self, name: str, args: Sequence[str], run_id: str):
        self.name = name
        argv = ["--host", "127.0.0.1", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", run_id,
                "--matchmaking-time", "2.5", "--request-timeout", "1.0", "--averaging-timeout", "8",
                *REFERENCE_OFF, *args]
        self._log = _Lines()
        root = logging.getLogger()
        self._level = root.level
        root.addHandler(self._log)
        root.setLevel(min(root.level, logging.INFO) if root.level else logging.INFO)
        self._loop = asyncio.new_event_loop()
        self._thread = None
        try:
            self.built = build(parse_config(argv))
            self.node = self.built.node
            self._runner = web.AppRunner(self.built.app, access_log=None)
            ready = threading.Event()
            failed: list[BaseException] = []

            def run():
                asyncio.set_event_loop(self._loop)
                try:
                    self._loop.run_until_complete(self._runner.setup())
                    self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", 0).start())
                except BaseException as e:  # handed to the constructor, which raises it
                    failed.append(e)
                    ready.set()
                    return
                ready.set()
                self._loop.run_forever()

            self._thread = threading.Thread(target=run, name=f"inproc-{name}", daemon=True)
            self._thread.start()
            if not ready.wait(START_TIMEOUT_S):
                raise TimeoutError(f"{name}: the app did not start listening in {START_TIMEOUT_S:.0f}s")
            if failed:
                raise failed[0]
            self.port = self._runner.addresses[0][1]
        except BaseException:
            self.kill()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        """The log lines of this process since the node was built."""
        return self._log.text()

    def get_json(self, path: str, timeout_s: float = 5.0):
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return json.loads(r.read())

    def status(self) -> dict:
        return self.get_json("/api/v1/swarm/status")

    def wait_ready(self, timeout_s: float = 0.0) -> list[str]:
        """Ready once constructed; the swarm multiaddrs, as NodeProcess.wait_ready returns them."""
        return [str(m) for m in self.node.maddrs]

    def kill(self) -> None:
        """Stop listening, then stop serving and training and leave the swarm. Safe to call twice."""
        if self._thread is not None and self._thread.is_alive():
            runner = getattr(self, "_runner", None)
            if runner is not None:
                asyncio.run_coroutine_threadsafe(_shut_down(runner), self._loop).result(STOP_TIMEOUT_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_TIMEOUT_S)
        self._thread = None
        built, self.built = getattr(self, "built", None), None
        if built is not None:
            built.close()
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()
        root = logging.getLogger()
        root.removeHandler(self._log)
        root.setLevel(self._level)
