"""Every node serves the swarm's bytes for a step, and knows whether its own gradient is in them.

After an update every peer publishes a record for the new epoch in the DHT (`dtrain_{run_id}_digests_{epoch}`):
the sha256 of its parameters, its state-sharing priority (`swarm.update_bonus`: a complete gradient round over a
failed one, distinct per peer), the group whose gradients its update averaged, and whether it
already serves those bytes. The rule:

1. A peer whose gradient round completed waits (bounded) for the records of its group; it stops waiting as soon
   as some peer serves the epoch, and stops waiting for a member that is neither announced nor connected (a peer
   that died after the round publishes nothing and serves nothing). A peer whose round failed does not wait.
2. The reference is the served record of highest priority if there is one, else the record of highest priority;
   a client-mode peer's record is the reference only when no full peer published one (its state can be downloaded
   by nobody, so its bytes can never be what the others serve).
   A peer serves the new step only with the reference's bytes: equal digests, or a download of the reference's
   state checked against its digest. Until then it keeps serving the previous step.
3. Its own gradient is in the swarm's update if it serves its own update's bytes, or if its round was complete
   and the group of the update it serves holds it. Otherwise the node carries it into its next update
   (`node.gradient`).

A served record outranks any later one, so a peer that updates later (alone after a failed round, say) follows the
peers that already serve. Records of the last KEEP_EPOCHS epochs are kept alive: a joiner of an idle swarm checks
its download at once. Downloads are checked against these records too: hivemind may label update e's state e + 1,
and a state downloaded from a peer inside an update can be torn.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Mapping, Optional

import hivemind
import torch
from hivemind.utils.logging import get_logger

from dtrain.node.swarm import records as dht_records
from dtrain.node.config import SwarmConfig
from dtrain.node.snapshot import PendingSnapshot, Snapshot, make_snapshot, params_digest
from dtrain.node.swarm.optimizer import RoundOutcome, SwarmOptimizer

logger = get_logger(__name__)

WAIT_MARGIN_S = 5.0  # added to the longest an update can take when a peer waits for the records of the others
GROUP_MARGIN_S = 2.0  # added to one state-averaging round when a peer waits for the records of its group
PRESENT_EVERY_S = 1.0  # how often a peer waiting for its group reads who is still announced
RECHECK_EVERY_S = 1.0
LOAD_ATTEMPTS = 5  # downloads of the swarm's state until its bytes match what peers published
RETRY_S = 1.0  # pause between two downloads: the peer it came from was inside an update
KEEP_EPOCHS = 2  # this peer's records kept alive: the epoch it serves and the one before
KEEP_ALIVE_S = 5.0  # how often they are refreshed (records live dht_records.RECORD_TTL_S)


@dataclass(frozen=True)
class Record:
    """One peer's parameters after one epoch."""

    digest: str
    priority: float  # its state-sharing priority: the epoch, plus a bonus when it made the update
    group: tuple[str, ...] = ()  # the peers whose gradients its update averaged (empty: it only caught up)
    clean: bool = False  # its gradient round completed
    served: bool = False  # it serves these bytes
    client: bool = False  # a client-mode peer's: nobody can download its state
    hparams: str = ""  # hyperparameters_digest of its optimizer: a download carries them too ("": not said)

    @classmethod
    def parse(cls, raw: Mapping) -> Optional["Record"]:
        try:
            return cls(digest=str(raw["digest"]), priority=float(raw["priority"]),
                       group=tuple(str(p) for p in raw.get("group", ())), clean=bool(raw.get("clean", False)),
                       served=bool(raw.get("served", False)), client=bool(raw.get("client", False)),
                       hparams=str(raw.get("hparams", "")))
        except (KeyError, TypeError, ValueError):
            return None

    def as_dict(self) -> dict:
        return dict(digest=self.digest, priority=self.priority, group=list(self.group), clean=self.clean,
                    served=self.served, client=self.client, hparams=self.hparams)


class Download(Enum):
    """How a download of the swarm's state compares with what the peers published."""

    CHECKED = "checked"  # the bytes the peers serve for its epoch (or the seeded model of epoch 0)
    UNCHECKED = "unchecked"  # no peer published anything for its epoch: nothing to compare with
    REFUSED = "refused"  # peers published other bytes for its epoch, every attempt: it must not be served


@dataclass(frozen=True)
class Verdict:
    """What a peer serves after an update, and whether that update applied its own gradient."""

    # None: the model holds bytes nobody vouched for; keep serving the last step. The PendingSnapshot it was given
    # when the swarm serves this peer's own bytes (made by the caller), a Snapshot of the bytes it followed
    snapshot: Optional[Snapshot | PendingSnapshot]
    included: bool  # the update the swarm serves holds this peer's gradient
    reference: str  # the peer whose bytes the swarm serves


def hyperparameters_digest(optimizer: torch.optim.Optimizer) -> str:
    """The sha256 of what a state download carries besides tensors: the optimizer's hyperparameters (every key of
    every parameter group but its parameters, and how many parameters the group holds). hivemind's download loads
    them with the state (`load_optimizer_state`), so a node whose parameters are the swarm's but whose learning rate
    is not would not hold the state a download gives it."""
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": len(group["params"])}
              for group in optimizer.param_groups]
    return hashlib.sha256(json.dumps(groups, sort_keys=True, default=repr).encode()).hexdigest()


def reference_of(records: Mapping[str, Record]) -> Optional[tuple[str, Record]]:
    """The peer whose bytes every peer serves for the epoch (rule 2 above)."""
    records = {p: r for p, r in records.items() if not r.client} or records
    served = {p: r for p, r in records.items() if r.served}
    pool = served or records
    if not pool:
        return None
    return max(pool.items(), key=lambda item: (item[1].priority, item[0]))


class Agreement:
    """One peer's side of the agreement; every method runs on the training thread (a recheck's reads between
    updates, and the refresh of this peer's records, on threads of their own)."""

    def __init__(self, dht: hivemind.DHT, optimizer: SwarmOptimizer, model: torch.nn.Module, config: SwarmConfig,
                 stop: threading.Event, seed_digest: str, owner: dht_records.RecordOwner,
                 present: Callable[[], Optional[set[str]]] = lambda: None):
        """`present`: the peers announced or connected now (node.swarm.presence.Presence.alive; None when that
        cannot be read)."""
        self.dht, self.optimizer, self.model, self._stop = dht, optimizer, model, stop
        self._present = present
        # the run's name in the DHT (keyed in a closed swarm, node.swarm.swarmkey); records are signed by `owner`
        self.run_id, self.owner, self.peer_id = optimizer.run_id, owner, owner.peer_id
        self.client = bool(optimizer.client_mode)  # records say so; such a peer sets no state-sharing priority
        self._matchmaking_time_s = config.matchmaking_time_s
        self.seed_digest = seed_digest  # this node's parameters of epoch 0 (seeded, or imported with --init-from)
        self._records: dict[int, Record] = {}  # epoch -> what this peer published for it (the last KEEP_EPOCHS)
        self._next_recheck = 0.0
        # between updates, rechecks read the records on a thread of their own: (epoch, what the last read found)
        self._reads = dht_records.ReadAhead(dht, "dtrain-recheck-read")
        self._read: Optional[tuple[int, dict[str, dict]]] = None
        self._swarm_epoch = 0  # the latest epoch of the swarm this peer has seen (see `saw`)
        threading.Thread(target=self._keep_alive, name="dtrain-records", daemon=True).start()

    @property
    def wait_s(self) -> float:
        """A peer whose gradient round failed matchmakes and waits out a state-averaging round too: it may finish
        two averaging timeouts after the others (the swarm's deadline now: node.swarm.deadlines)."""
        return WAIT_MARGIN_S + self._matchmaking_time_s + 2 * self.optimizer.averaging_timeout

    @property
    def group_wait_s(self) -> float:
        """The members of one complete gradient round publish within one state-averaging round of each other."""
        return GROUP_MARGIN_S + self._matchmaking_time_s + self.optimizer.averaging_timeout

    # ---- records ---------------------------------------------------------------------------------------------

    def _key(self, epoch: int) -> str:
        return f"dtrain_{self.run_id}_digests_{epoch}"

    def records(self, epoch: int) -> dict[str, Record]:
        return _parsed(dht_records.read(self.dht, self._key(epoch)))

    def _others(self, epoch: int) -> dict[str, Record]:
        return {p: r for p, r in self.records(epoch).items() if p != self.peer_id}

    def _publish(self, epoch: int, record: Record) -> None:
        self._records[epoch] = record
        for old in sorted(self._records)[:-KEEP_EPOCHS]:
            del self._records[old]
        dht_records.store(self.dht, self._key(epoch), self.owner, record.as_dict())

    @property
    def hparams(self) -> str:
        return hyperparameters_digest(self.optimizer.state_averager.optimizer)

    def vouch(self, snap: Snapshot) -> None:
        """Publish state this peer loaded and checked, or restored: a served record of its epoch, never a
        reference over a peer that made the update."""
        self._publish(snap.updates, Record(snap.digest, priority=float(snap.updates), served=True,
                                           client=self.client, hparams=self.hparams))

    def _keep_alive(self) -> None:
        """This peer's latest records refreshed every KEEP_ALIVE_S until the node stops (they expire after
        dht_records.RECORD_TTL_S), on a thread of its own: refreshed by the training thread between iterations,
        they lapsed during every outer round longer than their life (a GPT-2 small round on 2 cores behind
        20 Mbit/s takes a minute), and a joiner then found no record of the epoch its download came to."""
        while not self._stop.wait(KEEP_ALIVE_S):
            for epoch, record in list(self._records.items()):  # `_publish` replaces them on the training thread
                try:
                    dht_records.store(self.dht, self._key(epoch), self.owner, record.as_dict(), wait=False)
                except Exception as e:  # a DHT shutting down, or not answering: the next refresh may do
                    logger.debug(f"Refreshing the record of epoch {epoch} failed: {e!r}")

    # ---- downloads -----------------------------------------------------------------------------------------

    def saw(self, epoch: int) -> int:
        """Note that the swarm was at `epoch`; returns the latest epoch seen. The tracker's view of the swarm is
        its peers' progress records, which expire: a peer whose DHT stops answering leaves none a minute later, and
        the tracker then shows epoch 0. The swarm never goes back, so neither does this."""
        self._swarm_epoch = max(self._swarm_epoch, epoch)
        return self._swarm_epoch

    def load_state_from_peers(self, want_digest: Optional[str] = None) -> Download:
        """Download the swarm's parameters and optimizer state and check them against the records: the bytes
        the peers serve for the epoch they are labelled with, or exactly `want_digest`.

        A state downloaded while its peer is inside an update can be torn (stepped, not yet averaged), and hivemind
        labels a downloaded state with the swarm's next epoch when the swarm is one epoch ahead of it ("Catching
        up with collaboration step"): the bytes of update e served as step e + 2. The records tell which epoch the
        bytes are; anything else is downloaded again. This peer shares no state of its own until it serves again
        (`StepPublisher.publish`): its tensors are being overwritten. A download that got nothing leaves epoch 0
        and the seeded model, which is the swarm's state only while the swarm is at epoch 0; one that failed part-way
        (`torn`: written into the tensors as it arrived, node.swarm.download) leaves nothing to check.
        """
        opt = self.optimizer
        opt.state_averager.allow_state_sharing = False
        for attempt in range(LOAD_ATTEMPTS):
            if attempt and self._stop.wait(RETRY_S):
                return Download.REFUSED
            if self._stop.is_set():
                return Download.REFUSED
            logger.info("Loading the swarm's parameters and optimizer state from peers")
            opt.load_state_from_peers()
            if opt.state_averager.torn:
                logger.info("The download failed part-way: the tensors hold part of a peer's state; loading again")
                continue
            epoch, digest = opt.local_epoch, params_digest(self.model)
            if digest == want_digest:
                return Download.CHECKED
            if epoch == 0:
                swarm_epoch = self.saw(opt.tracker.global_epoch)
                if swarm_epoch == 0 and self.is_epoch_zero(digest):
                    return Download.CHECKED
                logger.info(f"No state of the swarm's epoch {swarm_epoch} came (no peer shared one, "
                            f"or it was not the swarm's start); loading again")
                continue
            # the peers may still be finishing this update; an older one's records are gone (peers keep their
            # last KEEP_EPOCHS alive), and waiting for them only leaves a slow joiner further behind. Looked at on
            # every turn: a download that filled a slow link held up the tracker's view of the swarm too, which
            # catches up a second or two after it
            deadline = time.monotonic() + self.wait_s
            while not (published := self._others(epoch)) and time.monotonic() < deadline and \
                    epoch > self.saw(opt.tracker.global_epoch) - KEEP_EPOCHS:
                if self._stop.wait(0.1):
                    return Download.REFUSED
            if _is_reference(published, digest):
                return Download.CHECKED
            if _has_digest(self._others(epoch - 1).values(), digest):
                logger.info(f"The downloaded state is that of update {epoch - 1}, labelled {epoch}; loading again")
                opt.state_averager.local_epoch = epoch - 1
            elif not published:
                logger.warning(f"No peer published its parameters for update {epoch}; keeping the download")
                return Download.UNCHECKED
            else:
                logger.info(f"The downloaded state is not the one peers serve for update {epoch} "
                            f"(caught inside an update); loading again")
        logger.warning("Could not download a state that agrees with what its peers published")
        return Download.REFUSED

    def check_download(self) -> Download:
        """State hivemind downloaded by itself inside step() ("Peer is out of sync"): kept when it is the bytes the
        peers serve for its epoch, else downloaded again through `load_state_from_peers`."""
        if self.optimizer.state_averager.torn:
            return self.load_state_from_peers()
        epoch, digest = self.optimizer.local_epoch, params_digest(self.model)
        published = self._others(epoch)
        if (epoch == 0 and self.is_epoch_zero(digest)) or _is_reference(published, digest):
            return Download.CHECKED
        return self.load_state_from_peers()

    def holds_swarm_start(self, digest: str, wait_s: float) -> bool:
        """A joiner of a swarm still at epoch 0 that built the swarm's start itself needs no download: True when the
        bytes the peers serve for epoch 0 (the reference of its records) are `digest`, with this node's optimizer
        hyperparameters. The rest of what a download carries is the optimizer's state, which no step has touched
        at epoch 0 on any node (AdamW's zero moments and step, the outer momentum's zeros: node.swarm.optimizer,
        node.lowcomm.outer), so it is this node's own. False when they differ, or when no peer publishes a record
        of epoch 0 within `wait_s` (then the joiner downloads: its own seed is no proof of the swarm's start)."""
        deadline = time.monotonic() + wait_s
        while not (published := self._others(0)):
            if time.monotonic() >= deadline or self._stop.wait(0.2):
                logger.info(f"No peer published the swarm's start within {wait_s:.0f}s")
                return False
        peer, start = reference_of(published)
        if start.digest != digest:
            logger.info(f"The swarm's start (peer {peer}'s epoch 0, sha256 {start.digest}) is not this node's "
                        f"(sha256 {digest})")
            return False
        if start.hparams != self.hparams:
            logger.info(f"The swarm's start (peer {peer}'s epoch 0) has this node's parameters, but another "
                        f"optimizer's hyperparameters")
            return False
        return True

    def is_epoch_zero(self, digest: str) -> bool:
        """The swarm's start: what its founder published for epoch 0 (a swarm started --init-from a checkpoint), or,
        when no one did, the seeded model every node builds alike."""
        published = self._others(0)
        return _is_reference(published, digest) if published else digest == self.seed_digest

    # ---- after an update -------------------------------------------------------------------------------------

    def after_update(self, snap: Snapshot | PendingSnapshot, outcome: RoundOutcome) -> Verdict:
        """Publish this peer's parameters of a new update, agree on the epoch's bytes (rules 1-3), return what to
        serve. Waits (at most `group_wait_s`) only for the members of a complete round's group: they all finished
        the same gradient round, so their records come within one state-averaging round of each other. A peer whose
        round failed waits for nobody: a served record outranks any later one, so later updaters follow it."""
        epoch = snap.updates
        mine = Record(snap.digest, self.optimizer.state_averager.state_sharing_priority,
                      group=outcome.group, clean=outcome.clean, client=self.client, hparams=self.hparams)
        self._publish(epoch, mine)
        waiting_for = set(outcome.group) - {self.peer_id} if outcome.clean else set()
        deadline = time.monotonic() + self.group_wait_s
        next_presence = time.monotonic() + PRESENT_EVERY_S
        while True:
            records = self.records(epoch)
            records[self.peer_id] = mine
            if any(r.served for r in records.values()) or waiting_for <= records.keys():
                break
            if time.monotonic() >= deadline:
                logger.info(f"update {epoch}: no record from {sorted(waiting_for - records.keys())} "
                            f"within {self.group_wait_s:.0f}s")
                break
            if time.monotonic() >= next_presence:
                next_presence = time.monotonic() + PRESENT_EVERY_S
                waiting_for -= self._gone(waiting_for - records.keys(), epoch)
            if self._stop.wait(0.05):
                break
        return self._serve(snap, mine, records)

    def _gone(self, silent: set[str], epoch: int) -> set[str]:
        """The members of `silent` neither announced nor connected: a peer that died after the round (its
        announcement expired, its connections closed) publishes no record and serves nothing; nobody waits for it."""
        announced = self._present()
        gone = silent - announced if announced is not None else set()
        if gone:
            logger.info(f"update {epoch}: {sorted(gone)} neither announced nor connected; not waiting for their "
                        f"records")
        return gone

    def _serve(self, snap: Snapshot | PendingSnapshot, mine: Record, records: dict[str, Record]) -> Verdict:
        epoch = snap.updates
        reference_peer, reference = reference_of(records)
        # serving its own update's bytes, a peer serves its own gradient (averaged, or alone after a failed round);
        # serving another's, only if that update's group held it and its own round completed
        origin = max((r for r in records.values() if r.digest == reference.digest and r.group),
                     key=lambda r: r.priority, default=reference)
        included = reference.digest == snap.digest or (mine.clean and self.peer_id in origin.group)
        if reference.digest != snap.digest and not self._stop.is_set():
            logger.warning(f"update {epoch}: parameters differ from those peer {reference_peer} serves; "
                           f"loading its state")
            # follow: below the reference, so that downloads of the others come from it
            if not self.client:
                self.optimizer.state_averager.state_sharing_priority = float(epoch)
            if self.load_state_from_peers(want_digest=reference.digest) is not Download.CHECKED:
                # never serve bytes that disagree with the swarm's: keep serving the last step, catch up later.
                # Whether the swarm's update holds this peer's gradient does not depend on that.
                logger.warning(f"update {epoch}: could not load peer {reference_peer}'s state; serving the last "
                               f"step until a download agrees with the swarm")
                return Verdict(None, included, reference_peer)
            snap = make_snapshot(self.model, self.optimizer.local_epoch)  # the reference's, or a later served state
        if snap.updates == epoch:
            self._publish(epoch, Record(snap.digest, self.optimizer.state_averager.state_sharing_priority,
                                        group=mine.group, clean=mine.clean, served=True, client=self.client,
                                        hparams=self.hparams))
        return Verdict(snap, included, reference_peer)

    def recheck(self, snap: Snapshot, force: bool = False) -> Snapshot:
        """Until this peer's next update: follow a peer that served the same epoch with a higher priority and other
        bytes, which only a race of two separate updates leaves. `force`d (right before an update) on a read of the
        records made now; else on the last of the reads made every RECHECK_EVERY_S on a thread of their own, so the
        training thread never waits for the DHT between updates."""
        mine = self._records.get(snap.updates)
        if mine is None or not mine.group:
            return snap
        if force:
            records = self.records(snap.updates)
        else:
            records = self._read_ahead(snap.updates)
            if records is None:
                return snap
        records[self.peer_id] = mine
        reference_peer, reference = reference_of(records)
        if reference.digest == snap.digest or self._stop.is_set():
            return snap
        logger.warning(f"update {snap.updates}: peer {reference_peer} serves other bytes with a higher priority; "
                       f"loading its state")
        return self._serve(snap, mine, records).snapshot

    def _read_ahead(self, epoch: int) -> Optional[dict[str, Record]]:
        """The records of `epoch` a read on its own thread found since the last call, or None; starts the next read
        when one is due."""
        read, self._read = self._read, None
        if time.monotonic() >= self._next_recheck:
            def found(records: dict[str, dict]) -> None:
                self._read = (epoch, records)

            if self._reads.start(self._key(epoch), then=found):
                self._next_recheck = time.monotonic() + RECHECK_EVERY_S
        return _parsed(read[1]) if read is not None and read[0] == epoch else None


def _parsed(found: Mapping[str, dict]) -> dict[str, Record]:
    parsed = {p: Record.parse(r) for p, r in found.items()}
    return {p: r for p, r in parsed.items() if r is not None}


def _is_reference(records: Mapping[str, Record], digest: str) -> bool:
    """These are the bytes the peers serve for the records' epoch (rule 2)."""
    return bool(records) and reference_of(records)[1].digest == digest


def _has_digest(records: Iterable[Record], digest: str) -> bool:
    return any(r.digest == digest for r in records)
