"""Checks on a running swarm of test nodes: equal steps mean equal bytes (polled continuously), and contributors
that submit disjoint sparse gradients over real HTTP from threads."""
from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from dtrain.bridge import dgrd
from tests.nodeproc import NodeProcess
from tests.test_bridge_semantics import submit

TENSOR = 0  # the token embedding: every packet moves its own coordinates of it
COORDS_PER_PACKET = 8


class ByteWatch:
    """Polls every node's /api/v1/swarm/status; records which digest each node served for each step."""

    def __init__(self, nodes: list[NodeProcess], interval_s: float = 0.2):
        self.nodes, self.interval_s = list(nodes), interval_s
        self.served: dict[int, dict[str, str]] = {}  # step -> node name -> digest
        self.conflicts: list[str] = []
        self.first_seen: dict[tuple[int, str], float] = {}  # (step, digest) -> when first served
        self.split_s = 0.0  # longest time any node served a step whose bytes another node served differently
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ByteWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def add(self, node: NodeProcess) -> None:
        self.nodes.append(node)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for node in list(self.nodes):
                try:
                    status = node.get_json("/api/v1/swarm/status", timeout_s=2.0)
                except (OSError, ValueError):
                    continue  # a node starting, stopping or killed
                self.record(node.name, status["step"], status["params_sha256"])

    def record(self, name: str, step: int, digest: str) -> None:
        now = time.monotonic()
        by_node = self.served.setdefault(step, {})
        by_node[name] = digest
        self.first_seen.setdefault((step, digest), now)
        if len(set(by_node.values())) > 1:
            self.conflicts.append(f"step {step}: {by_node}")
            first = min(t for (s, _), t in self.first_seen.items() if s == step)
            self.split_s = max(self.split_s, now - first)


@dataclass
class Contributions:
    """Contributors that each submit packets on coordinates no other packet touches."""

    tensor_elements: int
    accepted: list[tuple[str, np.ndarray]] = field(default_factory=list)  # (node name, coordinates)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _coordinates(self) -> np.ndarray:
        with self._lock:
            start = self._next
            self._next += COORDS_PER_PACKET * 997  # spread over the tensor
        return (start + np.arange(COORDS_PER_PACKET) * 997) % self.tensor_elements

    def submit(self, node: NodeProcess, contributor: str, attempts: int = 5) -> None:
        """One Mode 2 packet for the node's current step; retried on 409 (the step moved under it)."""
        coords = np.sort(self._coordinates())
        values = np.full(COORDS_PER_PACKET, 0.5, np.float32)
        for _ in range(attempts):
            step = node.get_json("/api/v1/model/info")["step"]
            packet = dgrd.encode(step, contributor, 3.0, 4, [(TENSOR, coords, values)], flags=dgrd.FLAGS_MODE2)
            status, body = node.in_netns(submit, node, packet)
            if status == 200:
                with self._lock:
                    self.accepted.append((node.name, coords))
                return
            assert status == 409, body
        raise AssertionError(f"{contributor}: 409 {attempts} times in a row")

    def round(self, nodes: list[NodeProcess], per_node: int, tag: str) -> None:
        """`per_node` contributors on every node submit at about the same time."""
        threads = [threading.Thread(target=self.submit, args=(node, f"{tag}-{node.name}-{i}"))
                   for node in nodes for i in range(per_node)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)


def tensor_f32(node: NodeProcess, tensor_id: int) -> tuple[int, np.ndarray]:
    def read():
        with urllib.request.urlopen(f"{node.url}/api/v1/model/tensor/{tensor_id}?format=f32", timeout=30) as r:
            return int(r.headers["X-Model-Step"]), np.frombuffer(r.read(), "<f4")
    return node.in_netns(read)


def all_applied(nodes: list[NodeProcess]) -> bool:
    """Every packet each node accepted is applied, and the nodes serve one step with one digest."""
    statuses = [n.status() for n in nodes]
    settled = all(s["applied_packets"] == s["accepted_packets"] and s["pending_samples"] == 0 for s in statuses)
    return settled and len({(s["step"], s["params_sha256"]) for s in statuses}) == 1
