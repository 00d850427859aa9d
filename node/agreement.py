"""Peers that update together serve byte-identical parameters.

A failed or timed-out averaging round leaves a peer with parameters of its own. After each update every peer
publishes the sha256 of its parameters (`swarm.publish_digest`) with its state-sharing priority, the epoch plus
a per-peer bonus in [0.5, 1) (`swarm.update_priority`). The peer of highest priority among those of an epoch is
its reference; a peer that differs from it loads the reference's state before it serves the step (hivemind
downloads from the peer of highest priority). A peer that made the update late, after the others had moved on,
has a lower bonus (`swarm.late_priority`), so it follows them. A peer that only caught up publishes with the bare
epoch: never a reference, but a record a joiner can check its download against. Every peer keeps its records of
the last KEEP_EPOCHS epochs alive: a joiner of an idle swarm, or a late peer, compares at once.

Every wait is bounded. A reference that publishes after a peer stopped waiting is caught by `recheck`, which
the training thread calls before its step() calls, and always right before the next update.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import hivemind
import torch
from hivemind.utils.logging import get_logger

from node import swarm
from node.config import SwarmConfig
from node.snapshot import Snapshot, make_snapshot, params_digest

logger = get_logger(__name__)

WAIT_MARGIN_S = 5.0  # added to the longest an update can take when a peer waits for the digests of the others
RECHECK_EVERY_S = 1.0
LOAD_ATTEMPTS = 5  # downloads of the swarm's state until its bytes match what peers published
KEEP_EPOCHS = 2  # this peer's records kept alive: the epoch it serves and the one before


def _has_digest(records: dict[str, dict], digest: str) -> bool:
    return any(r["digest"] == digest for r in records.values())


class Agreement:
    """One peer's side of the digest agreement; every method runs on the training thread."""

    def __init__(self, dht: hivemind.DHT, optimizer: hivemind.Optimizer, model: torch.nn.Module,
                 config: SwarmConfig, stop: threading.Event, seed_digest: str):
        self.dht, self.optimizer, self.model, self._stop = dht, optimizer, model, stop
        self.run_id, self.peer_id = config.run_id, str(dht.peer_id)
        # a peer whose gradient round failed matchmakes and waits out a state-averaging round too:
        # it may finish two averaging timeouts after the others
        self.wait_s = WAIT_MARGIN_S + config.matchmaking_time_s + 2 * config.averaging_timeout_s
        self.seed_digest = seed_digest  # the parameters of epoch 0 (the seeded model)
        self._records: dict[int, dict] = {}  # epoch -> what this peer published for it (the last KEEP_EPOCHS)
        self._update_epoch: Optional[int] = None  # the update of its own whose reference it keeps comparing with
        self._next_recheck = 0.0

    # ---- downloads -----------------------------------------------------------------------------------------

    def load_state_from_peers(self) -> bool:
        """Download the swarm's parameters and optimizer state: bytes that peers published for the epoch they are
        labelled with. False when no download could be checked that way (bounded attempts).

        A state downloaded while its peer is inside an update can be torn (stepped, not yet averaged), and hivemind
        labels a downloaded state with the swarm's next epoch when the swarm is one epoch ahead of it ("Catching
        up with collaboration step"): the bytes of update e served as step e + 2. The digests peers publish tell
        which epoch the bytes are; anything else is downloaded again. A failed download leaves this peer's own
        bytes, so its own record never confirms one.
        """
        opt = self.optimizer
        for attempt in range(LOAD_ATTEMPTS):
            logger.info("Loading the swarm's parameters and optimizer state from peers")
            opt.load_state_from_peers()
            epoch, digest = opt.local_epoch, params_digest(self.model)
            if epoch == 0:  # the seeded model is the only state of epoch 0
                if digest == self.seed_digest:
                    return True
                logger.info("The downloaded state is labelled 0 but is not the seeded model (caught inside the "
                            "first update); loading again")
                continue
            deadline = time.monotonic() + self.wait_s  # the peers may still be finishing this update
            while not (published := self._others(epoch)) and time.monotonic() < deadline:
                if self._stop.wait(0.1):
                    return False
            if _has_digest(published, digest):
                return True
            if _has_digest(self._others(epoch - 1), digest):
                logger.info(f"The downloaded state is that of update {epoch - 1}, labelled {epoch}; loading again")
                opt.state_averager.local_epoch = epoch - 1
            elif not published:
                logger.warning(f"No peer published its parameters for update {epoch}; keeping the download")
                return False
            else:
                logger.info(f"The downloaded state is none that peers published for update {epoch} "
                            f"(caught inside an update); loading again")
        logger.warning("Could not download a state that agrees with what its peers published")
        return False

    def check_download(self) -> bool:
        """State hivemind downloaded by itself inside step() ("Peer is out of sync"): kept when peers published its
        bytes for its epoch, else downloaded again through `load_state_from_peers`."""
        epoch, digest = self.optimizer.local_epoch, params_digest(self.model)
        if (epoch == 0 and digest == self.seed_digest) or _has_digest(self._others(epoch), digest):
            return True
        return self.load_state_from_peers()

    def _others(self, epoch: int) -> dict[str, dict]:
        records = swarm.list_digests(self.dht, self.run_id, epoch)
        return {peer: r for peer, r in records.items() if peer != self.peer_id}

    # ---- records ---------------------------------------------------------------------------------------------

    def vouch(self, snap: Snapshot) -> None:
        """Publish state this peer loaded and checked, or restored: a record of its epoch, never a reference."""
        self._update_epoch = None
        self._publish(snap, priority=snap.updates)

    def forget(self) -> None:
        """This peer serves state it could not check: nothing to publish or compare."""
        self._update_epoch = None

    def keep_alive(self) -> None:
        """Refresh this peer's latest records (records expire after swarm.NODES_TTL_S)."""
        for epoch, record in self._records.items():
            swarm.publish_digest(self.dht, self.run_id, epoch, self.peer_id, **record)

    def _publish(self, snap: Snapshot, priority: float) -> None:
        self._records[snap.updates] = record = dict(digest=snap.digest, priority=priority)
        for epoch in sorted(self._records)[:-KEEP_EPOCHS]:
            del self._records[epoch]
        swarm.publish_digest(self.dht, self.run_id, snap.updates, self.peer_id, **record)

    # ---- after an update -------------------------------------------------------------------------------------

    def after_update(self, snap: Snapshot, peers: int) -> Snapshot:
        """Publish this peer's parameters of a new update and agree with the `peers` peers that made it: returns
        `snap`, or the reference's state when it differs. Waits at most `wait_s` for their records."""
        epoch = snap.updates
        self._publish(snap, priority=self.optimizer.state_averager.state_sharing_priority)  # set by the update
        self._update_epoch = epoch
        if peers <= 1:
            return snap
        deadline = time.monotonic() + self.wait_s
        while True:
            records = swarm.list_digests(self.dht, self.run_id, epoch)
            # peers that updated (priority above the epoch), not those that only caught up to it
            updaters = {p for p, r in records.items() if r["priority"] > epoch} | {self.peer_id}
            if len(updaters) >= peers or time.monotonic() >= deadline:
                break
            if self._stop.wait(0.05):
                return snap
        return self._agree(snap, records)

    def recheck(self, snap: Snapshot, force: bool = False) -> Snapshot:
        """Until this peer's next update (at most every RECHECK_EVERY_S unless `force`d): agree with a reference
        that published after this peer compared, or that it did not know had taken part. Forced right before the
        next update: after it, a difference could no longer be repaired."""
        if snap.updates != self._update_epoch or (not force and time.monotonic() < self._next_recheck):
            return snap
        self._next_recheck = time.monotonic() + RECHECK_EVERY_S
        return self._agree(snap, swarm.list_digests(self.dht, self.run_id, snap.updates))

    def _agree(self, snap: Snapshot, records: dict[str, dict]) -> Snapshot:
        """`snap`, or the reference peer's parameters when they differ (then this peer loads its state)."""
        epoch, mine = snap.updates, self._records[snap.updates]
        others = {p: r for p, r in records.items() if p != self.peer_id and r["priority"] > mine["priority"]}
        if not others:
            return snap  # this peer is the reference
        reference_peer, reference = max(others.items(), key=lambda item: item[1]["priority"])
        if reference["digest"] == snap.digest or self._stop.is_set():
            return snap
        logger.warning(f"update {epoch}: parameters differ from those of peer {reference_peer} "
                       f"(an averaging round failed); loading its state")
        self.load_state_from_peers()  # checked against what peers published, whichever epoch it lands on
        snap = make_snapshot(self.model, self.optimizer.local_epoch)
        if snap.digest == reference["digest"]:
            logger.info(f"update {epoch}: parameters now equal peer {reference_peer}'s")
        else:
            logger.info(f"update {epoch}: loaded the swarm's state of update {snap.updates}")
        if snap.updates == epoch:
            self._publish(snap, priority=mine["priority"])
        return snap
