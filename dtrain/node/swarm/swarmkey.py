"""A closed swarm: a shared secret key that every peer of its DHT must hold (docs/peers.md).

hivemind's p2pd has no private-network (pre-shared key) option, so the key is checked one layer up, on every DHT
request and response. `SwarmKeyAuthorizer` is a hivemind authorizer: a request carries an HMAC-SHA256 of the
serialized message (its `auth.signature` cleared), which covers the request's DHT time and a random nonce; a
peer refuses a request whose HMAC does not match, whose time is more than `window_s` from its own, or whose nonce it
has seen, and drops a response whose HMAC does not match or that answers another request. A peer without the key can
neither join the DHT nor read or store anything in it.

The key also names the run: the DHT keys of the run (progress, averaging groups, the node's records) and the
averagers' RPC names are prefixed with `run_id + "_" + HMAC(key, run_id)[:16]`, so a peer without the key cannot
compute them. Names are no secret to a host that connects (libp2p's identify lists them): the RPCs that carry no
HMAC ask their caller to prove the key (node.swarm.keygate).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Callable, Optional

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.logging import get_logger
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from dtrain.node.config import ConfigError

logger = get_logger(__name__)

MIN_KEY_BYTES = 32  # a key shorter than this is refused: it could be guessed
WINDOW_S = 60.0  # a request is refused when its time is further than this from the receiver's DHT time
NONCE_BYTES = 16
MAKE_KEY_HINT = "make one with `head -c 32 /dev/urandom > swarm.key` and give every peer a copy"

# domain separation: a request's HMAC is never a valid response's, and the run prefix is no signing key
_REQUEST, _RESPONSE = b"dtrain-swarm-request\0", b"dtrain-swarm-response\0"
_AUTH_KEY, _RUN_KEY = b"dtrain-swarm-auth", b"dtrain-swarm-run"


class SwarmKeyError(ConfigError):
    """The --swarm-key file is missing, unreadable or too short; the message says which."""


class SwarmJoinError(SwarmKeyError):
    """A closed swarm's peer found none of its initial peers: they are down, or hold another key (or none)."""


def load_swarm_key(path: str | os.PathLike) -> bytes:
    """The key file's bytes, all of them (a key is random bytes, not text)."""
    try:
        key = Path(path).read_bytes()
    except FileNotFoundError:
        raise SwarmKeyError(f"--swarm-key {path}: no such file; {MAKE_KEY_HINT}") from None
    except OSError as e:
        raise SwarmKeyError(f"--swarm-key {path}: cannot read it ({e.strerror})") from None
    if len(key) < MIN_KEY_BYTES:
        raise SwarmKeyError(f"--swarm-key {path}: {len(key)} bytes, a key needs at least {MIN_KEY_BYTES}; "
                            f"{MAKE_KEY_HINT}")
    return key


def _derive(key: bytes, purpose: bytes) -> bytes:
    return hmac.new(key, purpose, hashlib.sha256).digest()


def keyed_run_id(key: bytes, run_id: str) -> str:
    """The run's name in the DHT: `run_id` plus 16 hex digits only holders of the key can compute."""
    tag = hmac.new(_derive(key, _RUN_KEY), run_id.encode(), hashlib.sha256).hexdigest()[:16]
    return f"{run_id}_{tag}"


class SwarmKeyAuthorizer(AuthorizerBase):
    """HMAC-SHA256 on every DHT request and response with a key all peers share; see the module docstring.

    Every method is pure computation on the message (no network); they are coroutines because hivemind awaits them.
    Seen nonces are kept for 2 * window_s: a request older than window_s is refused by its time anyway.
    """

    def __init__(self, key: bytes, window_s: float = WINDOW_S, clock: Callable[[], float] = get_dht_time):
        if len(key) < MIN_KEY_BYTES:
            raise SwarmKeyError(f"a swarm key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._mac_key = _derive(key, _AUTH_KEY)
        self.window_s = window_s
        self._clock = clock  # DHT time, seconds since the epoch
        self._seen_nonces = TimedStorage()

    def _mac(self, domain: bytes, message) -> bytes:
        """HMAC of `message` serialized with its auth.signature cleared (then put back as it was)."""
        signature, message.auth.signature = message.auth.signature, b""
        try:
            data = message.SerializeToString(deterministic=True)
        finally:
            message.auth.signature = signature
        return hmac.new(self._mac_key, domain + data, hashlib.sha256).digest()

    async def sign_request(self, request: AuthorizedRequestBase,
                           service_public_key: Optional[RSAPublicKey] = None) -> None:
        auth = request.auth
        auth.time = self._clock()
        auth.nonce = secrets.token_bytes(NONCE_BYTES)
        auth.signature = self._mac(_REQUEST, request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        if not hmac.compare_digest(auth.signature, self._mac(_REQUEST, request)):
            logger.debug("Refused a DHT request: no valid swarm key HMAC (a peer without the key, or tampered)")
            return False
        now = self._clock()
        if abs(auth.time - now) > self.window_s:
            logger.debug(f"Refused a DHT request made {now - auth.time:.1f}s from now (window {self.window_s:.0f}s)")
            return False
        if len(auth.nonce) != NONCE_BYTES or auth.nonce in self._seen_nonces:
            logger.debug("Refused a replayed DHT request")
            return False
        # no await between the check and the store: the event loop cannot let a replay in between
        self._seen_nonces.store(auth.nonce, None, now + 2 * self.window_s)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        response.auth.nonce = request.auth.nonce
        response.auth.signature = self._mac(_RESPONSE, response)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        if not hmac.compare_digest(auth.signature, self._mac(_RESPONSE, response)):
            logger.debug("Dropped a DHT response: no valid swarm key HMAC")
            return False
        if not hmac.compare_digest(auth.nonce, request.auth.nonce):
            logger.debug("Dropped a DHT response to another request")
            return False
        return True
