"""Who is in the swarm: every node announces itself in the DHT, idle or not (hivemind's progress records list
only the peers that are accumulating samples)."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils import get_dht_time, get_logger

from dtrain.node.swarm import records as dht_records

logger = get_logger(__name__)

ANNOUNCE_EVERY_S = 3.0  # how often a node refreshes its record
LIST_PEERS_TIMEOUT_S = 5.0
TRAINING_RECENTLY_S = 30.0  # a node that reported samples this recently announces itself as training


class PresenceSchema(pydantic.BaseModel):
    """The announcements' DHT entry: every subkey must name its signer (node.swarm.records), every value a dict."""

    nodes: Dict[BytesWithPublicKey, Dict[pydantic.StrictStr, Any]]


def presence_key(run_id: str) -> str:
    return f"dtrain_{run_id}_nodes"


def presence_validator(run_id: str) -> SchemaValidator:
    """Refuses an announcement under an unsigned subkey, or one that is not a dict, on every peer's DHT."""
    return SchemaValidator(PresenceSchema, prefix=f"dtrain_{run_id}")


@dataclass(frozen=True)
class PeerInfo:
    """What one node announced about itself."""

    peer_id: str
    step: int  # the step it serves
    bridge_port: int  # its Training API port
    maddrs: tuple[str, ...]  # some of its libp2p addresses
    training: bool  # it reported samples to the swarm in the last TRAINING_RECENTLY_S
    pending_samples: int  # samples it holds that no update applied yet
    time: float  # DHT time of the announcement (seconds since the epoch)
    model: Optional[dict] = None  # the shape of the model it trains (ModelConfig.architecture()), if it said
    epoch: int = -1  # the swarm epoch whose rounds it takes part in; -1 while it downloads the state

    @classmethod
    def from_record(cls, peer_id: str, record: Mapping) -> "PeerInfo":
        model = record.get("model")
        return cls(peer_id=peer_id, step=int(record.get("step", 0)), bridge_port=int(record.get("bridge_port", 0)),
                   maddrs=tuple(str(m) for m in record.get("maddrs", ())), training=bool(record.get("training")),
                   pending_samples=int(record.get("pending_samples", 0)), time=float(record.get("time", 0.0)),
                   model=dict(model) if isinstance(model, Mapping) else None, epoch=int(record.get("epoch", -1)))


class Presence:
    """This node's announcement and its view of the others (training thread only; `keep_fresh` waits for nothing)."""

    def __init__(self, dht: hivemind.DHT, run_id: str, owner: dht_records.RecordOwner, maddrs, bridge_port: int,
                 model: Optional[Mapping[str, int]] = None, epoch: Callable[[], int] = lambda: -1):
        """`epoch`: the swarm epoch this node is at (announced, but -1 while it downloads: `announcing`)."""
        self._dht, self._key, self._owner = dht, presence_key(run_id), owner
        self._epoch = epoch
        self._model = dict(model) if model is not None else None  # announced, so a joiner can check it first
        self.peer_id = owner.peer_id
        self._maddrs, self._bridge_port = tuple(maddrs)[:4], bridge_port
        self._last_announce = -ANNOUNCE_EVERY_S
        self._last_samples_at = -TRAINING_RECENTLY_S  # when this node last reported samples to the swarm
        self.nodes: dict[str, PeerInfo] = {}  # peer id -> its announcement, as of the last refresh
        self._own: Optional[dict] = None  # this node's last announcement
        self._reads = dht_records.ReadAhead(dht, "dtrain-presence-read")

    def reported_samples(self) -> None:
        self._last_samples_at = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self._last_announce >= ANNOUNCE_EVERY_S

    def refresh(self, step: int, pending_samples: int, downloading: bool = False) -> dict[str, PeerInfo]:
        """Announce this node and read everyone's announcements (this node's as it announced it now: the store is
        not waited for)."""
        self._announce(step, pending_samples, downloading)
        self._view(dht_records.read(self._dht, self._key))
        return self.nodes

    def alive(self, service) -> Optional[set[str]]:
        """The peers announced now (read now) or connected to this node's libp2p daemon (`service`: the node's
        node.swarm.service.NodeService); None when either read failed. A peer that is neither has gone: a live node
        whose training thread is busy with a long update lets its announcement lapse, but keeps its connections."""
        found = dht_records.lookup(self._dht, self._key)
        try:
            connected = {str(info.peer_id) for info in service.run(service.p2p.list_peers(), LIST_PEERS_TIMEOUT_S)}
        except Exception as e:
            logger.warning(f"Listing this node's connections failed: {e!r}")
            return None
        return set(found) | connected if found is not None else None

    def keep_fresh(self, step: int, pending_samples: int) -> None:
        """`refresh` for the training thread, which must not wait for the DHT: when due, this node announces itself
        and the others' announcements are read on a thread of its own, which sets `nodes` to what it found. A read
        that failed leaves `nodes` as it was: no answer is not an empty swarm."""
        if self.due():
            self._announce(step, pending_samples)
            self._reads.start(self._key, then=self._view)

    def _view(self, found: dict[str, dict]) -> None:
        found = dict(found)
        if self._own is not None:  # as this node last announced itself: its store is not waited for
            found[self.peer_id] = self._own
        self.nodes = {peer: PeerInfo.from_record(peer, r) for peer, r in found.items()}

    def _announce(self, step: int, pending_samples: int, downloading: bool = False) -> None:
        self._last_announce = time.monotonic()
        training = time.monotonic() - self._last_samples_at < TRAINING_RECENTLY_S
        record = dict(step=step, bridge_port=self._bridge_port, maddrs=list(self._maddrs), training=training,
                      pending_samples=pending_samples, time=get_dht_time(),
                      epoch=-1 if downloading else int(self._epoch()))
        if self._model is not None:
            record["model"] = self._model
        dht_records.store(self._dht, self._key, self._owner, record, wait=False)
        self._own = record

    def other_models(self) -> dict[str, dict]:
        """peer id -> the model shape each other node announced, read without announcing this one."""
        found = dht_records.read(self._dht, self._key)
        return {peer: info.model for peer, r in found.items() if peer != self.peer_id
                and (info := PeerInfo.from_record(peer, r)).model is not None}

    @contextlib.contextmanager
    def announcing(self, step: int, downloading: bool = True) -> Iterator[None]:
        """This node stays announced while the body runs, from a thread of its own every ANNOUNCE_EVERY_S: a
        download of the swarm's state, during which the training thread refreshes nothing, outlasts a record
        (RECORD_TTL_S) on any slow link, and the nodes it joins must not take themselves for alone meanwhile (they
        would update on every batch, and the joiner would arrive behind them). Announced as downloading (epoch -1),
        or at its epoch (`downloading` False: a replay of the rounds it missed). The training thread must not use
        this presence until the body is done."""
        stop = threading.Event()

        def keep_announcing() -> None:  # a store only: nobody reads the others' announcements meanwhile
            while not stop.wait(ANNOUNCE_EVERY_S):
                try:
                    self._announce(step, 0, downloading=downloading)
                except Exception as e:  # the next one may work; the download goes on either way
                    logger.warning(f"Announcing this node failed: {e!r}")

        self.refresh(step, 0, downloading=downloading)
        thread = threading.Thread(target=keep_announcing, name="dtrain-announce", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def alone(self) -> bool:
        """No other node announced itself recently."""
        return all(peer == self.peer_id for peer in self.nodes)
