"""The node's own libp2p RPCs (hivemind's are the DHT's and the averagers'): served, and called on other peers,
from a thread with an event loop of its own, like hivemind's DHT runs in its process. The dial-back check
(node.swarm.reachability) and the sparse swarm's round log (node.lowcomm.roundlog) live here. In a closed swarm
every handler first has its caller prove the swarm key (node.swarm.keygate).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable, Optional, TypeVar

from hivemind.p2p import P2P
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr

from dtrain.node.swarm.keygate import KeyGate, gate_handler

logger = get_logger(__name__)

START_TIMEOUT_S = 20.0
T = TypeVar("T")


class NodeService:
    """A client of the DHT's libp2p daemon on a thread of its own; see the module docstring."""

    def __init__(self, dht, swarm_key: Optional[bytes] = None, name: str = "dtrain-p2p"):
        # a client of our own (not dht.replicate_p2p()'s shared one), so that shutdown can close it with its tasks
        self._daemon_maddr = dht.run_coroutine(_daemon_listen_maddr)
        self._loop = asyncio.new_event_loop()
        self._p2p: Optional[P2P] = None
        self._key = swarm_key
        self._gate: Optional[KeyGate] = None
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        try:
            self.run(self._connect(), START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    async def _connect(self) -> None:
        self._p2p = await P2P.replicate(self._daemon_maddr)
        self._gate = KeyGate(self._key, self._p2p) if self._key else None

    @property
    def p2p(self) -> P2P:
        return self._p2p

    def run(self, coroutine: Awaitable[T], timeout_s: float) -> T:
        """Run `coroutine` on the service's loop and wait for it (bounded); from any other thread."""
        return self.submit(coroutine).result(timeout_s)

    def submit(self, coroutine: Awaitable[T]) -> concurrent.futures.Future:
        """Start `coroutine` on the service's loop; the caller waits for it (bounded) or cancels it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def add_handler(self, name: str, handler: Callable[..., Any], input_type, stream_output: bool = False) -> None:
        """Serve `handler` as `name` (hivemind's protobuf handlers), gated by the swarm key when there is one."""
        if self._gate is not None:
            handler = gate_handler(handler, self._gate, stream_output)
        self.run(self._p2p.add_protobuf_handler(name, handler, input_type, stream_output=stream_output),
                 START_TIMEOUT_S)

    async def _close(self) -> None:
        """Subclasses close what else they opened, then call this."""
        if self._p2p is not None:
            await self._p2p.shutdown()
        await asyncio.sleep(0.05)  # the cancelled reader and writer tasks finish

    def shutdown(self) -> None:
        """Close the client with its tasks on the loop that runs them: a P2P client collected later, away from its
        loop, fails in its finalizer."""
        if self._loop.is_running():
            try:
                self.run(self._close(), 10.0)
            except Exception as e:
                logger.debug(f"Node service shutdown: {e!r}")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()


async def _daemon_listen_maddr(dht, node) -> Multiaddr:
    """Run inside the DHT's process (DHT.run_coroutine): where its libp2p daemon takes clients."""
    return node.p2p.daemon_listen_maddr
