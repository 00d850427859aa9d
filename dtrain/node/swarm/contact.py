"""Contact with the peers a node trains with: found again after a network loss, and no update alone meanwhile.

A node whose network goes away while its process runs (a laptop closed, a Wi-Fi that drops) loses its libp2p
connections once they time out, and its DHT then forgets the peers. When the network comes back nothing dials them:
the node and the swarm train apart for good. Meanwhile the node, finding itself alone, updates alone at its own
pace, and its epoch runs ahead of the swarm's; met again, hivemind's tracker would take the higher epoch for the
swarm's and the swarm would download the bytes one node made alone.

`Contact` remembers every node the presence records showed, with its libp2p addresses, for REMEMBER_S after it was
last heard from. Every REACH_EVERY_S a thread of its own dials each that has not announced itself for QUIET_AFTER_S
at its addresses (nothing to do when connected) and pings it from the DHT; an answer puts each node back in the
other's routing table, which heals the split. A swarm whose nodes announce themselves sends no ping.
A node whose dial is refused has ended (its host answers, its port is closed) and is forgotten until it announces
itself again; `ended` says since when, so that a round no longer counts it (node.swarm.tracker) while its last
progress record and announcement linger in the DHT.

`isolated()`: this node remembers two or more peers and has heard from none of them for SILENT_AFTER_S. That many
peers leaving at once is less likely than this node losing its network, so it makes no update alone
(`SwarmOptimizer`): it goes on training, carries its rounds, and when it reaches them again it is behind and
catches up like any node behind, its pseudo-gradient carried into the swarm's next round. With one remembered peer
(a swarm of two) nothing tells whose link went, and each goes on alone as before.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Mapping, Optional

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr

from dtrain.node.swarm.presence import PeerInfo

logger = get_logger(__name__)

REACH_EVERY_S = 5.0
QUIET_AFTER_S = 10.0  # a peer is dialled and pinged once it has not announced itself (every 3 s) for this long
SILENT_AFTER_S = 20.0  # no answer and no announcement for this long: out of reach
REMEMBER_S = 600.0  # a peer not heard from for this long is forgotten: this node goes on as a swarm of its own
DIAL_TIMEOUT_S = 5.0
ANSWERED, REFUSED, SILENT = "answered", "refused", "silent"


@dataclass
class Known:
    maddrs: tuple[str, ...]  # its libp2p addresses, without the /p2p/ part
    heard: float  # DHT time it last answered a ping or announced itself


def dialable(maddrs) -> tuple[str, ...]:
    """`maddrs` as the daemon dials them: the /p2p/<peer id> part taken off."""
    return tuple(str(m).split("/p2p/")[0] for m in maddrs if str(m).split("/p2p/")[0])


async def reach(peer_id: str, maddrs: tuple[str, ...], _dht, node) -> str:
    """In the DHT's process: ANSWERED if `peer_id`, dialled at `maddrs` unless connected, answers a DHT ping;
    REFUSED if the dial is refused; SILENT otherwise. The dial comes first: a ping's own failed dial would put the
    peer in libp2p's dial backoff, and the dial after it would say only that."""
    peer = PeerID.from_base58(peer_id)
    try:
        await asyncio.wait_for(node.protocol.p2p._client.connect(peer, [Multiaddr(m) for m in maddrs]),
                               DIAL_TIMEOUT_S)
    except Exception as e:
        return REFUSED if "connection refused" in str(e) else SILENT
    return ANSWERED if await node.protocol.call_ping(peer) is not None else SILENT


class Contact:
    """The peers this node remembers, reached again every REACH_EVERY_S on a thread of its own (`start`)."""

    def __init__(self, dht: hivemind.DHT, peer_id: str, announced: Callable[[], Mapping[str, PeerInfo]],
                 clock: Callable[[], float] = time.time):
        """`announced`: peer id -> what it announced (node.swarm.presence.PeerInfo: `maddrs`, `time`)."""
        self._dht, self._peer_id, self._announced, self._clock = dht, peer_id, announced, clock
        self.known: dict[str, Known] = {}
        self._ended: dict[str, float] = {}  # peer id -> DHT time its dial was last refused, for REMEMBER_S
        self._reached_now_at = float("-inf")  # the last `reach_now` (monotonic)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._was_isolated = False

    def start(self) -> "Contact":
        self._thread = threading.Thread(target=self._run, name="dtrain-contact", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)  # a round of pings in flight ends on its own (daemon thread)

    def isolated(self) -> bool:
        """Two or more peers remembered, none heard from for SILENT_AFTER_S."""
        self.note_announcements()
        now = self._clock()
        with self._lock:
            heard = [k.heard for k in self.known.values()]
        return len(heard) >= 2 and all(now - t > SILENT_AFTER_S for t in heard)

    def ended(self) -> dict[str, float]:
        """peer id -> DHT time this node found the peer's process ended (its dial refused), within REMEMBER_S."""
        with self._lock:
            return dict(self._ended)

    def _log_change(self) -> None:
        isolated = self.isolated()
        if isolated != self._was_isolated:
            self._was_isolated = isolated
            if isolated:
                logger.warning(f"This node reaches none of the {len(self.known)} peers it trained with: it makes no "
                               f"update alone while it calls them again (for up to {REMEMBER_S:.0f}s)")
            elif self.known:
                logger.info("This node reaches its peers again")
            else:
                logger.warning(f"This node reached none of its peers for {REMEMBER_S:.0f}s: it goes on as a swarm of "
                               f"its own")

    def note_announcements(self) -> None:
        """Remembers every other node the presence records show, as heard when it announced itself, but for one
        whose process it found ended since (its announcement outlives it: pinged again, it was refused again)."""
        for peer, info in dict(self._announced()).items():
            if peer == self._peer_id:
                continue
            maddrs, announced_at = dialable(info.maddrs), float(info.time)
            with self._lock:
                if self._ended.get(peer, float("-inf")) >= announced_at:
                    continue
                known = self.known.get(peer)
                if known is None:
                    self.known[peer] = Known(maddrs, announced_at)
                else:
                    known.maddrs = maddrs or known.maddrs
                    known.heard = max(known.heard, announced_at)

    def reach_now(self) -> dict[str, str]:
        """Pings every remembered peer heard from in the last QUIET_AFTER_S, the ones `reach_all` leaves alone, at most
        once per REACH_EVERY_S, and waits for the answers (at most 3 x DIAL_TIMEOUT_S). For a node whose round just
        failed: a peer that was in it and whose process has ended is known so (`ended`) before the node's next round
        counts that peer's lingering record again. Peers quiet for longer are the thread's to ping: an isolated node,
        whose rounds all fail, waits for no dial here."""
        with self._lock:
            if time.monotonic() - self._reached_now_at < REACH_EVERY_S:
                return {}
            self._reached_now_at = time.monotonic()
        return self._reach(lambda quiet_s: quiet_s <= QUIET_AFTER_S)

    def reach_all(self) -> dict[str, str]:
        """Pings once (concurrently, in the DHT's process) every remembered peer not heard from for QUIET_AFTER_S: one
        that announces itself needs no ping. Forgets those refused and those not heard from for REMEMBER_S. Returns
        peer id -> ANSWERED, REFUSED or SILENT."""
        return self._reach(lambda quiet_s: quiet_s > QUIET_AFTER_S)

    def _reach(self, select: Callable[[float], bool]) -> dict[str, str]:
        """`reach_all` for the peers `select` picks by how long they have been quiet."""
        self.note_announcements()
        now = self._clock()
        with self._lock:
            for peer in [p for p, k in self.known.items() if now - k.heard > REMEMBER_S]:
                del self.known[peer]
            self._ended = {peer: t for peer, t in self._ended.items() if now - t <= REMEMBER_S}
            targets = {peer: k.maddrs for peer, k in self.known.items() if select(now - k.heard)}
        if not targets:
            return {}
        futures = {peer: self._dht.run_coroutine(partial(reach, peer, maddrs), return_future=True)
                   for peer, maddrs in targets.items()}
        outcomes, deadline = {}, time.monotonic() + DIAL_TIMEOUT_S * 3
        for peer, future in futures.items():
            try:
                outcomes[peer] = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:
                logger.debug(f"Reaching {peer} failed: {e!r}")
                outcomes[peer] = SILENT
        now = self._clock()
        with self._lock:
            for peer, outcome in outcomes.items():
                if peer not in self.known:
                    continue
                if outcome == ANSWERED:
                    self.known[peer].heard = now
                elif outcome == REFUSED:
                    del self.known[peer]
                    self._ended[peer] = now
        return outcomes

    def _run(self) -> None:
        while not self._stop.wait(REACH_EVERY_S):
            try:
                self.reach_all()
                self._log_change()
            except Exception as e:  # the next round may work; the node trains either way
                if not self._stop.is_set():
                    logger.warning(f"Reaching this node's peers failed: {e!r}")
