"""A counter read at a fixed interval on a thread of its own (a node's updates, a host's received bytes), and how
much it grew between two times. Used by tests and benches alike."""
from __future__ import annotations

import subprocess
import threading
import time
from typing import Callable

# a read that fails this way is skipped: a node busy or gone for a moment, a namespace being torn down
SKIPPED = (OSError, TimeoutError, ValueError, KeyError, subprocess.SubprocessError)


class Sampler:
    """`read()` every `every_s` seconds, kept as (time.time(), value) in `samples`, from entering to leaving."""

    def __init__(self, read: Callable[[], int], every_s: float):
        self._read, self._every_s = read, every_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                self.samples.append((time.time(), int(self._read())))
            except SKIPPED:
                continue

    def increase(self, start: float, end: float) -> int:
        """How much the counter grew between the first and the last sample in [start, end] (0 with fewer than two)."""
        inside = [value for t, value in self.samples if start <= t <= end]
        return inside[-1] - inside[0] if len(inside) >= 2 else 0

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
