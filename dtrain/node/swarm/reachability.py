"""Can the swarm's peers dial this node? A dial-back check at start, and the service that answers it for others.

A node behind a home router can dial out, so it sees the swarm and the swarm sees its connections; what it cannot
do is accept a connection, and a full hivemind peer must: the leader of an averaging group, a reducer of a part of
the all-reduce, a peer others download state from are all dialed. Whether the addresses a node announces work is
only known from outside, so it asks (as Petals' servers do at start):

1. Before its DHT starts, the node starts a temporary libp2p host on the same listen and announce addresses and
   connects (outwards) to its initial peers.
2. It asks each of them (up to MAX_ASKED) through `CHECK_HANDLER` to dial it back on the announced addresses.
3. An asked peer dials from a probe host of its own (`ReachabilityService`): a separate libp2p host, never the
   connection the asker opened, which would prove nothing. A dial succeeds only if the peer at those addresses
   proves the asker's peer id (libp2p's secure handshake) and answers `PING_HANDLER`.
4. Reachable if at least half of the peers that answered could dial back; unreachable if none could and at least
   one answered; unchecked if none answered or there is no one to ask (the first node of a swarm).

The check says nothing about the node's bridge port (browsers), only about its libp2p addresses. In a closed swarm
a peer answers the check only for askers that prove the swarm key (node.swarm.keygate).
"""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

from google.protobuf import wrappers_pb2
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr

from dtrain.node.swarm.keygate import add_prover
from dtrain.node.swarm.service import NodeService

logger = get_logger(__name__)

CHECK_HANDLER = "dtrain.reachability.check"  # asker -> helper: {"peer_id": ..., "maddrs": [...]} -> dialed back?
PING_HANDLER = "dtrain.reachability.ping"  # helper's probe -> asker: proves the asker's host answers
MAX_ASKED = 5  # initial peers asked to dial back
MAX_MADDRS = 16  # announced addresses a helper dials, at most
MAX_MADDR_CHARS = 256
MAX_REQUEST_CHARS = 8192
DIAL_TIMEOUT_S = 5.0  # one dial-back by a helper (all of the asker's addresses)
ASK_TIMEOUT_S = 2 * DIAL_TIMEOUT_S + 2.0  # one question to one helper, its dial-back included
START_TIMEOUT_S = 20.0  # the temporary host's start and its first connections


class ReachabilityError(ValueError):
    """A dial-back request that is malformed or out of bounds."""


@dataclass(frozen=True)
class CheckResult:
    """What the swarm's peers said about this node's announced addresses."""

    verdict: str  # "reachable", "unreachable" or "unchecked"
    asked: int  # peers asked to dial back
    answered: int  # of them, peers that answered
    dialed: int  # of them, peers that could dial this node back
    detail: str = ""  # why unchecked, in words

    def as_dict(self) -> dict:
        return dict(verdict=self.verdict, asked=self.asked, answered=self.answered, dialed=self.dialed,
                    detail=self.detail)


def verdict_of(answered: int, dialed: int) -> str:
    if answered == 0:
        return "unchecked"
    if dialed == 0:
        return "unreachable"
    return "reachable" if 2 * dialed >= answered else "unreachable"


def encode_request(peer_id: str, maddrs: Sequence[str]) -> wrappers_pb2.StringValue:
    return wrappers_pb2.StringValue(value=json.dumps({"peer_id": peer_id, "maddrs": list(maddrs)[:MAX_MADDRS]}))


def decode_request(raw: str) -> tuple[PeerID, list[Multiaddr]]:
    """The peer to dial and its direct (non-relayed) addresses; ReachabilityError for anything else."""
    if len(raw) > MAX_REQUEST_CHARS:
        raise ReachabilityError(f"request of {len(raw)} characters > {MAX_REQUEST_CHARS}")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ReachabilityError(f"request is not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("peer_id"), str) or not isinstance(
            data.get("maddrs"), list):
        raise ReachabilityError("request must be {\"peer_id\": str, \"maddrs\": [str, ...]}")
    try:
        peer_id = PeerID.from_base58(data["peer_id"])
        if not _is_multihash(peer_id.to_bytes()):
            raise ValueError("not a multihash (identity or sha2-256)")
    except Exception as e:
        raise ReachabilityError(f"peer_id {data['peer_id'][:64]!r} is not a peer id: {e}") from None
    if len(data["maddrs"]) > MAX_MADDRS:
        raise ReachabilityError(f"{len(data['maddrs'])} addresses > {MAX_MADDRS}")
    maddrs = []
    for text in data["maddrs"]:
        if not isinstance(text, str) or len(text) > MAX_MADDR_CHARS:
            raise ReachabilityError(f"address {str(text)[:64]!r} is not a string of <= {MAX_MADDR_CHARS} characters")
        if "/p2p-circuit" in text:
            continue  # a relayed address proves nothing about the node's own
        try:
            maddr = Multiaddr(text)
        except Exception as e:
            raise ReachabilityError(f"address {text!r} is not a multiaddr: {e}") from None
        if "p2p" in maddr.protocols() or "ipfs" in maddr.protocols():
            maddr = maddr.decapsulate(Multiaddr(f"/p2p/{peer_id}"))
        maddrs.append(maddr)
    if not maddrs:
        raise ReachabilityError("no direct address to dial")
    return peer_id, maddrs


def _is_multihash(raw: bytes) -> bool:
    """A libp2p peer id is a multihash of the peer's public key: identity-hashed (ed25519) or sha2-256 (RSA)."""
    identity = len(raw) >= 2 and raw[0] == 0x00 and raw[1] == len(raw) - 2
    sha256 = len(raw) == 34 and raw[0] == 0x12 and raw[1] == 0x20
    return identity or sha256


def peer_ids_of(initial_peers: Sequence[str]) -> list[PeerID]:
    """The distinct peer ids named in multiaddrs (`.../p2p/<id>`), in order."""
    ids: list[PeerID] = []
    for text in initial_peers:
        try:
            peer = PeerID.from_base58(Multiaddr(text).value_for_protocol("p2p"))
        except Exception:
            continue
        if peer not in ids:
            ids.append(peer)
    return ids


async def _ping(request: wrappers_pb2.BoolValue, context: P2PContext) -> wrappers_pb2.BoolValue:
    return wrappers_pb2.BoolValue(value=True)


async def _dial_back(probe: P2P, peer_id: PeerID, maddrs: list[Multiaddr]) -> bool:
    """Connect to `peer_id` at `maddrs` from `probe` and call its ping; False on any failure within the bound."""
    async def dial():
        await probe._client.connect(peer_id, maddrs)
        answer = await probe.call_protobuf_handler(peer_id, PING_HANDLER, wrappers_pb2.BoolValue(value=True),
                                                   wrappers_pb2.BoolValue)
        return bool(answer.value)
    try:
        return await asyncio.wait_for(dial(), DIAL_TIMEOUT_S)
    except Exception as e:
        logger.debug(f"Dial-back to {peer_id} at {[str(m) for m in maddrs]} failed: {e!r}")
        return False
    finally:
        try:
            await asyncio.wait_for(probe._client.disconnect(peer_id), 2.0)
        except Exception:
            pass


async def _check(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
                 identity_path: Optional[str], swarm_key: Optional[bytes] = None) -> CheckResult:
    helpers = peer_ids_of(initial_peers)[:MAX_ASKED]
    if not helpers:
        return CheckResult("unchecked", 0, 0, 0, "no initial peer to ask")
    target = await asyncio.wait_for(P2P.create(
        initial_peers=list(initial_peers), host_maddrs=list(host_maddrs), announce_maddrs=list(announce_maddrs) or None,
        use_relay=False, use_auto_relay=False, nat_port_map=False, auto_nat=False,
        identity_path=identity_path, check_if_identity_free=False), START_TIMEOUT_S)
    try:
        await target.add_protobuf_handler(PING_HANDLER, _ping, wrappers_pb2.BoolValue)
        if swarm_key:
            await add_prover(target, swarm_key)
        maddrs = [str(m) for m in await target.get_visible_maddrs(latest=True)]
        request = encode_request(str(target.peer_id), maddrs)

        async def ask(helper: PeerID) -> Optional[bool]:
            try:
                answer = await asyncio.wait_for(target.call_protobuf_handler(
                    helper, CHECK_HANDLER, request, wrappers_pb2.BoolValue), ASK_TIMEOUT_S)
                return bool(answer.value)
            except Exception as e:
                logger.debug(f"Peer {helper} did not answer the reachability check: {e!r}")
                return None

        answers = await asyncio.gather(*(ask(h) for h in helpers))
    finally:
        await target.shutdown()
    answered = [a for a in answers if a is not None]
    dialed = sum(answered)
    detail = "" if answered else f"none of the {len(helpers)} peers asked answered"
    return CheckResult(verdict_of(len(answered), dialed), len(helpers), len(answered), dialed, detail)


def check_reachability(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
                       identity_path: Optional[str] = None, swarm_key: Optional[bytes] = None) -> CheckResult:
    """Ask the initial peers to dial this node back on what it would announce (bounded). Runs on a thread with a
    loop of its own: the node starts from inside its bridge's event loop. In a closed swarm (`swarm_key`) the
    peers asked first have this node prove the key (node.swarm.keygate)."""
    bound_s = START_TIMEOUT_S + ASK_TIMEOUT_S + 10.0
    result: list = []

    def run():
        try:
            result.append(asyncio.run(asyncio.wait_for(
                _check(initial_peers, host_maddrs, announce_maddrs, identity_path, swarm_key), bound_s)))
        except BaseException as e:  # a host that would not start, a bound that ran out: nothing was learned
            result.append(e)

    thread = threading.Thread(target=run, name="dtrain-reachability-check", daemon=True)
    thread.start()
    thread.join(bound_s + 5.0)
    outcome = result[0] if result else TimeoutError(f"no answer within {bound_s:.0f}s")
    if isinstance(outcome, CheckResult):
        return outcome
    logger.warning(f"Reachability check failed: {outcome!r}")
    return CheckResult("unchecked", 0, 0, 0, f"the check failed: {outcome!r}")


class ReachabilityService(NodeService):
    """Answers other nodes' dial-back requests (CHECK_HANDLER) on this node's libp2p host; dials from a probe host
    of its own, started on the first request."""

    def __init__(self, dht, swarm_key: Optional[bytes] = None):
        self._probe: Optional[P2P] = None
        self._probe_lock: Optional[asyncio.Lock] = None
        self._dials: Optional[asyncio.Semaphore] = None
        super().__init__(dht, swarm_key, name="dtrain-p2p")
        try:
            self.run(self._make_locks(), START_TIMEOUT_S)
            self.add_handler(CHECK_HANDLER, self._handle, wrappers_pb2.StringValue)
        except BaseException:
            self.shutdown()
            raise

    async def _make_locks(self) -> None:
        self._probe_lock = asyncio.Lock()
        self._dials = asyncio.Semaphore(4)  # dial-backs at once: each holds a probe connection for seconds

    async def _get_probe(self) -> P2P:
        async with self._probe_lock:
            if self._probe is None:
                self._probe = await P2P.create(host_maddrs=[], no_listen=True, use_relay=False, use_auto_relay=False,
                                               nat_port_map=False, auto_nat=False)
            return self._probe

    async def _handle(self, request: wrappers_pb2.StringValue, context: P2PContext) -> wrappers_pb2.BoolValue:
        try:
            peer_id, maddrs = decode_request(request.value)
        except ReachabilityError as e:
            logger.info(f"Refused a reachability check from {context.remote_id}: {e}")
            return wrappers_pb2.BoolValue(value=False)
        if peer_id != context.remote_id:
            logger.info(f"Refused a reachability check from {context.remote_id} for another peer, {peer_id}")
            return wrappers_pb2.BoolValue(value=False)
        async with self._dials:
            ok = await _dial_back(await self._get_probe(), peer_id, maddrs)
        logger.info(f"Reachability check for {peer_id}: {'dialed back' if ok else 'could not dial'} "
                    f"{[str(m) for m in maddrs]}")
        return wrappers_pb2.BoolValue(value=ok)

    async def _close(self) -> None:
        if self._probe is not None:
            await self._probe.shutdown()
        await super()._close()


@dataclass(frozen=True)
class Reachability:
    """How this node takes part in the swarm, and why: shown in its log, on its dashboard and in
    /api/v1/swarm/status (`reachability`)."""

    mode: str  # "public": a full peer others dial; "client": dials out only (hivemind's client mode)
    check: CheckResult
    relay: bool  # libp2p relays are used (a client-mode node also looks for one to be reached through)
    chosen_by: str  # "check", or "flag" (--reachability public|client)

    def as_dict(self) -> dict:
        return dict(mode=self.mode, relay=self.relay, chosen_by=self.chosen_by, **self.check.as_dict())

    def describe(self) -> str:
        c = self.check
        if self.chosen_by == "flag":
            how = f"--reachability {self.mode}"
        elif c.verdict == "unchecked":
            how = f"not checked ({c.detail})"
        else:
            how = f"{c.dialed} of {c.answered} peers asked could dial this node back"
        role = ("a full peer" if self.mode == "public" else
                "a client-mode peer: it dials out only, averages gradients in groups that public peers lead and "
                "shares no state")
        return f"Reachability: {how}; joining as {role}" + ("" if self.relay else " (relays off)")


def decide(mode_flag: str, relay: bool, initial_peers: Sequence[str], host_maddrs: Sequence[str],
           announce_maddrs: Sequence[str], identity_path: Optional[str] = None,
           swarm_key: Optional[bytes] = None) -> Reachability:
    """`--reachability` auto asks the initial peers (check_reachability) and joins in client mode only when they
    answered and none could dial back: a check that learned nothing keeps a full peer, as before the check existed."""
    if mode_flag in ("public", "client"):
        return Reachability(mode_flag, CheckResult("unchecked", 0, 0, 0, f"--reachability {mode_flag}"), relay, "flag")
    if mode_flag != "auto":
        raise ReachabilityError(f"--reachability {mode_flag!r}: expected auto, public or client")
    check = check_reachability(initial_peers, host_maddrs, announce_maddrs, identity_path, swarm_key)
    return Reachability("client" if check.verdict == "unreachable" else "public", check, relay, "check")
