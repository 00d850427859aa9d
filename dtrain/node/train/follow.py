"""How a node takes the swarm's state: when it joins, and whenever it falls behind or holds bytes the swarm
disagrees with (docs/low-communication.md, "How a node joins").

- At the join (the main thread, before the training thread starts): the swarm's model checked against this node's,
  then a download, checked against the records the peers publish for its epoch (node.swarm.agreement), in ranges
  from several donors (--state-donors) or from one peer through hivemind, announced all along.
- Later (the training thread): a replay of the rounds it missed where the round log holds them
  (node.lowcomm.roundlog), else a download; then the downloaded bytes are served and the round in progress goes on
  on top of them, arriving late into the epoch the others have trained part of.
- Every download from one peer collects the rounds the swarm makes meanwhile, so the replay after it does not
  depend on the peers' logs still holding them (`CatchUp.collecting`).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

from hivemind.utils.logging import get_logger

from dtrain.node.config import ConfigError
from dtrain.node.lowcomm.statefetch import SpreadDownload
from dtrain.node.snapshot import make_snapshot, params_digest
from dtrain.node.swarm.agreement import Download
from dtrain.node.swarm.presence import ANNOUNCE_EVERY_S

if TYPE_CHECKING:  # the node core (node.train.trainer), which imports this module
    from dtrain.node.train.trainer import TrainingNode

logger = get_logger(__name__)

# how long a joiner, announced, waits before it downloads: two of every node's looks at the announcements
JOIN_ANNOUNCE_S = 2 * ANNOUNCE_EVERY_S
FRESH_READ_WAIT_S = 3.0  # the longest a node that caught up waits for a read of the swarm's progress (arrive_late)


class SwarmFollower:
    """The node's side of taking the swarm's state (see the module's docstring)."""

    def __init__(self, node: "TrainingNode", stop: threading.Event):
        self.node, self.stop = node, stop

    def check_swarm_model(self) -> None:
        """A joiner builds the swarm's model or stops here, before it downloads or averages anything: the nodes
        already in the swarm announce the shape they train."""
        node = self.node
        ours = node.model_config.architecture()
        models = node.presence.other_models()
        if not models:  # just bootstrapped: the announcements may take a moment to reach this node
            self.stop.wait(1.0)
            models = node.presence.other_models()
        for peer, theirs in models.items():
            if theirs != ours:
                differs = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
                raise ConfigError(
                    f"the swarm trains another model: node {peer} announces {theirs}, this node builds {ours} "
                    f"(differing, swarm vs this node: {differs}); start it with the swarm's --model-config, or "
                    f"--init-from a checkpoint of the same shape")

    def join_download(self, timeout_s: float) -> Download:
        """A joiner serves nothing the swarm disagrees with: it downloads until the bytes agree (bounded)."""
        node = self.node
        swarm = node.config.swarm
        if node.low_comm and swarm.wire_codec == "sparse" and swarm.state_donors > 0:
            # at once: a donor asked for ranges is not alone (TrainingNode.alone), so what it updates meanwhile is
            # in its round log, which brings the ranges forward
            node.presence.refresh(0, 0)  # announced while it downloads, as below
            spread = SpreadDownload(node.swarm, node.agreement, node.model, node.catchup, swarm.topk_fraction,
                                    swarm.state_donors, self.stop,
                                    announce=lambda: node.presence.due() and node.presence.refresh(0, 0))
            try:
                if spread.run(timeout_s):
                    return Download.CHECKED
            except Exception as e:  # whatever went wrong, the download below overwrites what it wrote
                logger.exception(f"The download in ranges failed: {e!r}")
            logger.info("The download in ranges did not give the swarm's state; downloading it from one peer")
        self._until_seen()
        deadline = time.monotonic() + timeout_s
        while True:
            # announced while it downloads, so that the nodes it joins are not alone: they make outer rounds every
            # --inner-steps (per-step: gather --local-samples-per-update) instead of an update per batch, which a
            # download that takes longer never catches (the joiner would arrive behind them and download again)
            with node.presence.announcing(0), self._collecting():
                result = node.agreement.load_state_from_peers()
            if result is not Download.REFUSED:
                break
            if self.stop.is_set() or time.monotonic() >= deadline:
                raise RuntimeError(f"could not download a state that agrees with what the swarm's peers publish "
                                   f"within {timeout_s:.0f}s; is the swarm training faster than this link?")
        return result

    def _until_seen(self) -> None:
        """A node alone until it reads this one's announcement makes updates as a node alone, which no round log
        holds, so a state copied from it before its last such update lands behind it with nothing to replay, and
        the joiner downloads it all again: with one other node, the joiner waits for that node to read its
        announcement before hivemind's download (a download in ranges tells the donor itself). Two or more see
        each other and none is alone."""
        node = self.node
        others = [peer for peer in node.presence.refresh(0, 0) if peer != node.swarm.peer_id]
        if len(others) == 1:
            logger.info(f"Node {others[0]} may take itself for alone: waiting {JOIN_ANNOUNCE_S:g}s for it to read "
                        f"this node's announcement before the download")
            self.stop.wait(JOIN_ANNOUNCE_S)

    def after_join_download(self) -> None:
        """A joiner's download lands behind the rounds the swarm made meanwhile: it replays them at once, by a fresh
        read of the swarm's epoch (the tracker's may be from before the download ended), and arrives late into the
        epoch the others train, its round due with theirs. TrainingNode._join then starts its training at once: it
        was announced all through its download and replay, and its progress record names its epoch, by which the
        others' next round counts it. A joiner that waited there for its announcement to be read arrived with its
        round due while the others' round closed without it, and replayed that round too."""
        node = self.node
        fresh = node.swarm.optimizer.read_swarm_epoch()
        if not self.catch_up(node.agreement.saw(fresh if fresh is not None else -1)):
            self.arrive_late()  # nothing to catch up: it arrives late all the same

    def serves_my_bytes(self) -> bool:
        """A restored checkpoint of the swarm's current epoch: do the peers serve the same bytes?"""
        node = self.node
        epoch = node.swarm.epoch
        records = node.agreement.records(epoch)
        return not records or any(r.digest == params_digest(node.model) for r in records.values())

    def catch_up(self, swarm_epoch: int = -1) -> bool:
        """A node behind the swarm (by its tracker, or at `swarm_epoch` read otherwise), or holding bytes the swarm
        disagrees with, takes the swarm's state: by replaying the rounds it missed where it can, else by a download
        (nothing pending is dropped), and arrives late into the swarm's epoch. False if there was nothing to take."""
        node = self.node
        opt = node.swarm.optimizer
        swarm_epoch = max(opt.tracker.global_epoch, swarm_epoch)
        if swarm_epoch > opt.local_epoch:
            # the swarm moved on without us: take its state (nothing pending is dropped)
            logger.info(f"Behind the swarm (epoch {opt.local_epoch} < {swarm_epoch}); loading state")
        elif not node.unverified:
            return False
        if node.rounds is not None:
            node.rounds.enter_outer()  # the pseudo-gradient aside: the download replaces the parameters
        # announced meanwhile, as a joiner's first download (join_download): a replay over a slow link outlasts an
        # announcement too (the default model's 4 rounds took 29 s at 20 Mbit/s), and a node that finds itself
        # alone then makes updates no round log holds, which this node could only download whole. A replay is
        # announced at the node's epoch, not as a download: one epoch behind with its round due, the others' next
        # round counts it and waits for it within matchmaking's time (node.swarm.tracker), where announced as
        # downloading it was counted out, and it arrived a second or two after their group had closed, round
        # after round, over a slow link
        try:
            replayed = False
            if node.catchup is not None and not node.unverified:
                with node.presence.announcing(node.step, downloading=False):
                    replayed = node.catchup.replay()
            if replayed:
                download = Download.CHECKED  # the replayed bytes are the ones the peers publish
            else:
                with node.presence.announcing(node.step):
                    download = self._download_to_catch_up()
        except Exception as e:  # a peer or link that failed mid-way: as a download refused, tried again next turn
            logger.exception(f"Catching up failed: {e!r}")
            download = Download.REFUSED
        # whatever came of it, the round goes on on top of the parameters it left: a catch-up that raised past this
        # left the node inside the outer round it entered above, and every inner update after it failed
        self.after_catch_up(download)
        self.arrive_late()
        return True

    def _download_to_catch_up(self) -> Download:
        node = self.node
        opt = node.swarm.optimizer
        with self._collecting():
            download = node.agreement.load_state_from_peers()
        if download is Download.UNCHECKED and node.catchup is not None and \
                node.agreement.saw(opt.tracker.global_epoch) > opt.local_epoch:
            # the peers' records of the downloaded epoch expired while it came (it took longer than their last rounds):
            # brought to the swarm's epoch by replay, it is checked against that epoch's records
            before = params_digest(node.model)
            if node.catchup.replay():
                download = Download.CHECKED
            elif params_digest(node.model) != before:  # a replay that did not give the swarm's bytes
                download = Download.REFUSED
        return download

    def _collecting(self):
        """While a download runs: the rounds made meanwhile, for the replay after it (node.lowcomm.roundlog)."""
        return self.node.catchup.collecting() if self.node.catchup is not None else contextlib.nullcontext()

    def arrive_late(self) -> None:
        """Low-comm: a node that arrives in an epoch the others have trained part of (after a download or a replay)
        is a late contributor. Its round is due about when theirs is, with the inner updates it made by then, instead
        of a whole round after its arrival, which the others would wait for once theirs are done: its inner updates
        are counted from the others' samples in the epoch so far (its local batch each). If its round misses
        theirs (they began it before they counted this node), it makes no update of its own in that epoch: it
        replays theirs and carries its pseudo-gradient into the next round, where an update of its own would have
        been bytes they do not have, and a download of the whole state after it."""
        node = self.node
        if node.rounds is None or node.unverified:
            return
        # by a read after its state came, and by the others that read counted: the read from before showed the
        # swarm as it was then, and even a fresh one may not hold this node's own record at its new epoch yet
        # (counted by num_peers, the node looked alone: "nobody else trains"). A joiner of a founder so trained a
        # whole round before its first while the founder, done with its own inner updates, waited for it
        tracker = node.swarm.optimizer.tracker
        progress = tracker.fresh_progress(FRESH_READ_WAIT_S) or tracker.global_progress
        others = tracker.others_counted(progress.epoch)
        if progress.epoch != node.swarm.epoch or progress.samples_accumulated <= 0 or others == 0:
            return  # nobody else trains in this epoch (a node alone counts its own samples): it arrives nowhere
        node.swarm.optimizer.arrived_in = progress.epoch  # no update alone in it (SwarmOptimizer._no_round_alone)
        done = int(progress.samples_accumulated / others / max(1, node.config.local_batch_size))
        late = min(node.rounds.inner_steps - 1, max(done, 0))
        if late > node.rounds.steps:
            logger.info(f"Arrived in epoch {progress.epoch} after about {late} of its {node.rounds.inner_steps} inner "
                        f"updates: this node's round is due with the others'")
            node.rounds.steps = late

    def after_catch_up(self, download: Download) -> None:
        """The swarm's state is in the model (or a download was refused): serve it, then the round goes on on top."""
        node = self.node
        try:
            self._serve_download(download)
        finally:
            if node.rounds is not None:  # once the downloaded bytes are served: on top of them, for the next round
                node.rounds.carry()
                node.rounds.share_anchor()
                node.publisher.share_state()

    def _serve_download(self, download: Download) -> None:
        node = self.node
        if node.gradient.samples:
            node.gradient.carry()
        if download is Download.REFUSED:
            node.unverified = True
            logger.warning(f"Serving step {node.step} until a download agrees with the swarm")
            return
        node.unverified = False
        served = node.snapshot()
        if node.swarm.epoch == served.updates and params_digest(node.model) == served.digest:
            node.publisher.share_state()
            return  # nothing new: no copy and FP16 conversion of the whole model
        snap = make_snapshot(node.model, node.swarm.epoch)
        if download is Download.CHECKED:
            node.agreement.vouch(snap)
        else:
            logger.warning(f"Serving update {snap.updates} without a check against its peers' records")
        node.publisher.publish(snap)

    def recheck(self, force: bool) -> None:
        """Follow a peer that served this epoch's bytes with a higher priority (node.swarm.agreement.recheck)."""
        node = self.node
        snap = node.publisher.snapshot
        agreed = node.agreement.recheck(snap, force)
        if agreed is None:
            node.unverified = True
        elif agreed is not snap:
            node.publisher.publish(agreed)
