"""A closed swarm's RPCs answer only callers that prove they hold the swarm key (docs/peers.md).

The DHT's messages carry an HMAC (node.swarm.swarmkey), but hivemind's averagers (matchmaking, the all-reduce, the
state download) and the node's reachability check speak protobufs that have no field for one, and libp2p's
identify protocol lists their names to any host that connects. So the server asks: before a handler runs for a
caller it has not admitted yet, `KeyGate` sends that caller a random nonce over the caller's own connection and
admits it only if the answer is HMAC(key, nonce + caller's peer id + server's peer id). libp2p's secure handshake
proves both peer ids, so an answer is good for one caller, one server and one nonce: it cannot be replayed, nor
relayed from a key holder (whose answer would name it, not the caller). Every node of a closed swarm answers these
challenges (`add_prover`), client-mode peers included: the challenge travels on the connection the caller opened.

An admitted peer stays admitted (it proved the key, and a key does not change while a node runs); a refused one is
refused without a new challenge for `REFUSED_FOR_S`.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable, Optional

from google.protobuf import wrappers_pb2
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

PROVE_HANDLER = "dtrain.swarm.prove"
NONCE_BYTES = 32
PROVE_TIMEOUT_S = 5.0  # one challenge, on a connection that is already open
REFUSED_FOR_S = 60.0
MAX_REMEMBERED = 4096  # admitted and refused peers, each
_PROVE_KEY = b"dtrain-swarm-prove"


class KeyRefused(PermissionError):
    """The caller did not prove that it holds the swarm key."""


def proof(key: bytes, nonce: bytes, asker: PeerID, prover: PeerID) -> bytes:
    """The answer to `asker`'s challenge `nonce`, computed by `prover`. Peer ids are self-delimiting multihashes."""
    mac_key = hmac.new(key, _PROVE_KEY, hashlib.sha256).digest()
    return hmac.new(mac_key, nonce + asker.to_bytes() + prover.to_bytes(), hashlib.sha256).digest()


async def add_prover(p2p: P2P, key: bytes) -> None:
    """Answer other peers' challenges on `p2p`'s daemon (one prover per daemon)."""
    async def prove(request: wrappers_pb2.BytesValue, context: P2PContext) -> wrappers_pb2.BytesValue:
        if len(request.value) != NONCE_BYTES:
            return wrappers_pb2.BytesValue(value=b"")
        return wrappers_pb2.BytesValue(value=proof(key, request.value, context.remote_id, context.local_id))

    await p2p.add_protobuf_handler(PROVE_HANDLER, prove, wrappers_pb2.BytesValue)


async def _add_prover_in_dht(_dht, node, key: bytes) -> None:
    await add_prover(node.p2p, key)


def start_prover(dht, key: bytes) -> None:
    """Answer challenges on the daemon of a running hivemind.DHT (from the DHT's own process)."""
    dht.run_coroutine(partial(_add_prover_in_dht, key=key))


class KeyGate:
    """Admits the callers of one P2P client's handlers; see the module docstring."""

    def __init__(self, key: bytes, p2p: P2P):
        self._key, self._p2p = key, p2p
        self._admitted: OrderedDict[PeerID, None] = OrderedDict()
        self._refused: OrderedDict[PeerID, float] = OrderedDict()
        self._pending: dict[PeerID, asyncio.Future] = {}

    async def check(self, context: P2PContext) -> None:
        """Return if the caller holds the key; KeyRefused otherwise."""
        peer = context.remote_id
        if peer in self._admitted:
            return
        refused_at = self._refused.get(peer)
        if refused_at is not None and time.monotonic() - refused_at < REFUSED_FOR_S:
            raise KeyRefused(f"{peer} did not prove the swarm key")
        challenge = self._pending.get(peer)
        if challenge is None:  # concurrent calls of one new peer share one challenge
            challenge = self._pending[peer] = asyncio.ensure_future(self._challenge(peer, context.local_id))
            challenge.add_done_callback(lambda _: self._pending.pop(peer, None))
        if not await asyncio.shield(challenge):
            raise KeyRefused(f"{peer} did not prove the swarm key")

    async def _challenge(self, peer: PeerID, local: PeerID) -> bool:
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            answer = await asyncio.wait_for(self._p2p.call_protobuf_handler(
                peer, PROVE_HANDLER, wrappers_pb2.BytesValue(value=nonce), wrappers_pb2.BytesValue), PROVE_TIMEOUT_S)
            ok = hmac.compare_digest(answer.value, proof(self._key, nonce, local, peer))
        except Exception as e:  # no prover (no key, or not a dtrain node), a timeout, a broken connection
            logger.debug(f"Challenge to {peer} failed: {e!r}")
            ok = False
        remembered = self._admitted if ok else self._refused
        remembered[peer] = None if ok else time.monotonic()
        remembered.move_to_end(peer)
        while len(remembered) > MAX_REMEMBERED:
            remembered.popitem(last=False)
        if not ok:
            logger.info(f"Refused RPCs from {peer}: it did not prove the swarm key")
        return ok


def gate_handler(method: Callable[..., Any], gate: KeyGate, stream_output: bool) -> Callable[..., Any]:
    """`method` (a hivemind protobuf handler: request, context) that first checks its caller."""
    if stream_output:
        async def call(request, context):
            await gate.check(context)
            async for item in method(request, context):
                yield item
    else:
        async def call(request, context):
            await gate.check(context)
            return await method(request, context)
    return call


def gated(servicer: Any, gate: KeyGate, handlers) -> Any:
    """An object with `servicer`'s RPC handlers (hivemind RPCHandler records) that first check the caller."""
    return SimpleNamespace(**{h.method_name: gate_handler(getattr(servicer, h.method_name), gate, h.stream_output)
                              for h in handlers})


class KeyGatedServicer:
    """Mixin for a hivemind averager (a ServicerBase): with `swarm_key`, each of its RPCs admits only callers that
    prove the key. It comes first in the bases, so its add_p2p_handlers wraps the averager's own."""

    def __init__(self, *args, swarm_key: Optional[bytes] = None, **kwargs):
        self._swarm_key = swarm_key  # before the averager's __init__, which may start its process
        super().__init__(*args, **kwargs)

    async def add_p2p_handlers(self, p2p: P2P, wrapper: Any = None, *, namespace: Optional[str] = None,
                               balanced: bool = False) -> None:
        if self._swarm_key is None:
            return await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)
        self._collect_rpc_handlers()
        servicer = gated(self if wrapper is None else wrapper, KeyGate(self._swarm_key, p2p), self._rpc_handlers)
        await super().add_p2p_handlers(p2p, servicer, namespace=namespace, balanced=balanced)
