"""The bridge's checks before a packet reaches the node: token, samples cap, rate limits.

Order in the submit route, cheapest and least trusting first, each answered before anything is applied:

1. `authorize(headers)`: with `--contributor-tokens FILE`, a request without `Authorization: Bearer <token>`
   naming one of the file's tokens is `401`, before its body is read. Open (no file) by default.
2. `check_address(remote)`: optional token bucket per client address, `429` (off by default: behind a
   reverse proxy every browser has the proxy's address).
3. After `dgrd.decode` (a malformed packet is `400` first, as NOTES.md orders):
   `check_packet(node_id, samples)`:
   - `samples` above `max_samples_per_packet` is rejected with `400` naming the cap. Rejected rather than
     clipped: a packet is applied entirely or not at all (as for every other 400), the contributor learns
     the cap from the answer (and `/api/v1/model/info`'s `train.max_samples_per_packet`) instead of being
     silently credited less than it claimed, and the ledger's samples mean what was claimed and applied;
   - then a token bucket per `node_id`: over it, `429` with `Retry-After` (whole seconds).

Errors are `bridge.http.ApiError`s; each gate error carries the ledger's `RejectReason` (or None for a
401, which names no node_id) so the route can count it.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from aiohttp import web
from hivemind.utils.logging import get_logger

from dtrain.bridge.http import ApiError, RetryLater
from dtrain.node.train.ledger import RejectReason

logger = get_logger(__name__)

DEFAULT_MAX_SAMPLES_PER_PACKET = 256  # the largest batch /api/v1/data/batch hands out: more no browser trains


class GateConfigError(ValueError):
    """A gate option or the tokens file is unusable; the message says which and why."""


@dataclass(frozen=True)
class GateConfig:
    """What the bridge lets through to the node."""

    max_samples_per_packet: int = DEFAULT_MAX_SAMPLES_PER_PACKET  # samples one packet may claim; above: 400
    rate_per_s: float = 2.0  # packets per second per node_id, sustained; 0: no limit
    burst: int = 10  # packets a node_id may send back to back before rate_per_s applies
    address_rate_per_s: float = 0.0  # packets per second per client address; 0: no limit
    address_burst: int = 40  # packets per client address back to back
    contributor_tokens: Optional[str] = None  # path: one bearer token per line (# comments); None: open
    max_tracked: int = 10_000  # rate-limit buckets kept (keys are attacker-chosen); least recently used go

    def __post_init__(self):
        if not isinstance(self.max_samples_per_packet, int) or self.max_samples_per_packet < 1:
            raise GateConfigError(f"max_samples_per_packet must be an integer >= 1, got {self.max_samples_per_packet!r}")
        if self.rate_per_s < 0 or self.address_rate_per_s < 0:
            raise GateConfigError("rate limits must be >= 0 packets per second (0 turns one off)")
        if self.burst < 1 or self.address_burst < 1:
            raise GateConfigError("burst sizes must be >= 1 packet")
        if self.max_tracked < 1:
            raise GateConfigError(f"max_tracked must be >= 1, got {self.max_tracked}")


class GateError(ApiError):
    """A request the gate refused; `reason` is what the ledger counts it as (None: no node_id to count)."""

    reason: Optional[RejectReason] = None


class Unauthorized(GateError):
    def __init__(self, message: str):
        super().__init__(401, message)

    def response(self) -> web.Response:
        response = super().response()
        response.headers["WWW-Authenticate"] = 'Bearer realm="dtrain"'
        return response


class SamplesAboveCap(GateError):
    reason = RejectReason.SAMPLES_CAP

    def __init__(self, samples: int, cap: int, server_step: Optional[int] = None):
        super().__init__(400, f"samples {samples} exceeds max_samples_per_packet {cap}; send at most {cap} "
                              f"samples per packet (split a larger batch)", server_step=server_step)


class RateLimited(GateError, RetryLater):
    reason = RejectReason.RATE_LIMITED

    def __init__(self, who: str, retry_after_s: float, server_step: Optional[int] = None):
        wait_s = max(1, math.ceil(retry_after_s))  # Retry-After is whole seconds
        super().__init__(429, f"rate limit for {who}: retry after {wait_s} s", wait_s, server_step=server_step)


def load_tokens(path: str | Path) -> frozenset[bytes]:
    """The SHA-256 digests of the file's tokens: one per line, blank lines and `#` comments skipped.

    Digests, not tokens, are kept and compared: a lookup's timing then says nothing about a token's bytes.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise GateConfigError(f"--contributor-tokens {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GateConfigError(f"--contributor-tokens {path}: cannot read it ({e})") from None
    tokens = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not tokens:
        raise GateConfigError(f"--contributor-tokens {path}: no tokens in it; every packet would be refused")
    if any(any(ch.isspace() for ch in t) for t in tokens):
        raise GateConfigError(f"--contributor-tokens {path}: a token contains whitespace; one token per line")
    return frozenset(hashlib.sha256(t.encode()).digest() for t in tokens)


class TokenBuckets:
    """One token bucket per key, at most `max_keys` of them (least recently used forgotten). Not locked."""

    def __init__(self, rate_per_s: float, burst: int, max_keys: int, clock: Callable[[], float]):
        self.rate_per_s, self.burst, self.max_keys, self._clock = rate_per_s, burst, max_keys, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> float:
        """Take one token: 0.0 if there was one, else the seconds until there will be (nothing taken)."""
        now = self._clock()
        tokens, at = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate_per_s
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)  # forgetting a bucket refills it: bounded memory wins here
        return wait


class Gate:
    """The checks of one bridge; thread-safe (the submit route decodes off the event loop)."""

    def __init__(self, config: GateConfig = GateConfig(), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._tokens = load_tokens(config.contributor_tokens) if config.contributor_tokens else None
        self._by_node = (TokenBuckets(config.rate_per_s, config.burst, config.max_tracked, clock)
                         if config.rate_per_s > 0 else None)
        self._by_address = (TokenBuckets(config.address_rate_per_s, config.address_burst, config.max_tracked, clock)
                            if config.address_rate_per_s > 0 else None)
        self._lock = threading.Lock()
        if self._tokens is not None:
            logger.info(f"closed swarm: {len(self._tokens)} contributor token(s) from {config.contributor_tokens}")

    @property
    def closed(self) -> bool:
        return self._tokens is not None

    def authorize(self, headers: Mapping[str, str]) -> None:
        """401 unless the swarm is open or `Authorization: Bearer <token>` names a known token."""
        if self._tokens is None:
            return
        value = headers.get("Authorization", "")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("this node accepts contributions only with a contributor token: "
                               "send 'Authorization: Bearer <token>'")
        if hashlib.sha256(token.strip().encode()).digest() not in self._tokens:
            raise Unauthorized("unknown contributor token")

    def check_address(self, remote: Optional[str]) -> None:
        """429 when the client address is over its bucket (only with address_rate_per_s > 0)."""
        if self._by_address is None:
            return
        with self._lock:
            wait = self._by_address.take(remote or "?")
        if wait > 0:
            raise RateLimited(f"address {remote}", wait)

    def check_packet(self, node_id: str, samples: int, server_step: Optional[int] = None) -> None:
        """400 above the samples cap (no token taken), then 429 when node_id is over its bucket."""
        cap = self.config.max_samples_per_packet
        if samples > cap:
            raise SamplesAboveCap(samples, cap, server_step)
        if self._by_node is None:
            return
        with self._lock:
            wait = self._by_node.take(node_id)
        if wait > 0:
            raise RateLimited(f"node_id {node_id!r}", wait, server_step)
