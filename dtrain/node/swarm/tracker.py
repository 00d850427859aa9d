"""When an update of the swarm begins: hivemind's progress tracker with the swarm's own rule."""
from __future__ import annotations

import time
from typing import Callable, Iterable, Optional

from hivemind.optim.progress_tracker import GlobalTrainingProgress, LocalTrainingProgress, ProgressTracker
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from dtrain.node.swarm.others import Others

READ_WAIT_S = 10.0  # the longest a round waits for a read of the swarm's progress after one that gave no update


class PacedTracker(ProgressTracker):
    """hivemind's tracker with the swarm's own rule for when an update begins (docs/architecture.md, "When the swarm updates").

    An update begins when the swarm moved to a later epoch, when the swarm's pending samples reach the target, or
    once they stopped growing for `settle_s`. Two of hivemind's rules are left out:
    - its estimate of when the target will be reached. It extrapolates each peer's samples per second, which a
      bridge's bursts of packets make meaningless: a node that took 4 samples in 10 ms expected the rest at once and
      updated alone while its peer's packet was still on the way;
    - reaching the target while this peer's view of the swarm's progress shows no one else although other nodes
      announced themselves (a node that joined or just received its first packet has not read their progress yet).
      Then the settle rule decides, which waits long enough for the progress of every peer to be read.

    The peers a round counts are those at the swarm's epoch: by their progress record, by their announcement
    (node.swarm.presence), and this peer by what it knows of itself. A peer behind is downloading its state or
    replaying the rounds it missed, in no round of this epoch; counted (hivemind counts every record), it made this
    peer's round look for a group it never joined. A record alone is not enough either way: hivemind stops publishing
    the progress of a peer with no samples of its own two epochs on, so a full peer that only joins client-mode
    peers' rounds keeps a record behind while it is in every one of them. A peer whose announcement says it downloads
    the state, later than its progress record was written, counts by neither: a node that came back with the
    identity it left with finds its old record at the swarm's epoch when the others made no update since it left
    (their rounds looked for it), and counted by it, it made their next round look for it through its download.

    A peer whose process this node found ended (its dial refused, node.swarm.contact) after its progress record was
    written counts by neither either. Its record stays in the DHT until it expires, at the swarm's epoch when it left
    right after a round: in a swarm of two, the node left behind counted it for three rounds, each looking for it
    until the averaging deadline (the first two carried: FAILED_ROUNDS_CARRIED), before it updated alone. Counted
    out, the node's next round after the one that found the peer gone is an update alone. A node that comes back
    with the same identity writes a newer record and counts again.

    A peer one epoch behind whose round is due (its record says so, below) counts too, unless it was missing from
    this peer's last round although counted for it. It is the one the others' last round went without: it came late to
    that round's group (with rounds of a second or two, three nodes left a different one out of each round, each one's
    catching up by replay taking about as long as a round). It catches up in a fraction of a round and brings its
    gradient to this one, so the group waits for it, within matchmaking's time, instead of closing without it again. A
    peer that left while its round was due is counted for the one round that finds it missing, not for the next.

    A low-comm node whose round is due trains no more in this epoch, and its progress record says so: a rate of 0
    samples per second (hivemind's own estimate is never 0: it starts at 1e-20). Once every other peer the round
    counts says so at the swarm's epoch, the round begins without the settle rule's wait, which every node spent
    idle (2 s of every outer round, a tenth of the default model's round with two nodes on two cores). A peer that
    does not say so (an older node, one with nothing to train) leaves the settle rule to decide, as before.

    How often it reads the swarm's progress: hivemind reads it as often as the target is near, which for a low-comm
    swarm (a target of one sample) is every `min_refresh_period`, through the whole round: a DHT lookup and a pipe
    handed to the DHT's process, five times a second per node, for a count no one needs until a round is due (0.05
    of a core per node, measured with two nodes). While this node's round is not due, it reads every
    `between_rounds_s`: often enough to see that the swarm moved on or that peers arrived. When the round becomes
    due (`round_is_due`), the next read comes at once and then at hivemind's pace again, which the settle rule needs.
    """

    def __init__(self, *args, settle_s: float, others: Optional[Others] = None,
                 round_due: Optional[Callable[[], bool]] = None, between_rounds_s: float = 3.0,
                 on_swarm_epoch: Callable[[int], None] = lambda epoch: None, **kwargs):
        """`others`: what the node knows of the other peers (node.swarm.others); a swarm without announcements (the
        adapter's, node.serve.adapter) takes them to be present always; None: it knows of no one."""
        others = others if others is not None else Others()
        self.settle_s = settle_s
        self.between_rounds_s = between_rounds_s
        self.others_present = others.present  # whether other nodes announced themselves
        # what each node announced: peer id -> the epoch it is at (-1 while it downloads), and peer id -> when each
        # node that announces a download of the state announced it
        self.announced_epochs = lambda: {peer: info.epoch for peer, info in others.announced().items()}
        self.downloading = lambda: {peer: info.time for peer, info in others.announced().items() if info.epoch < 0}
        self.ended = others.ended  # peer id -> when this node found its process ended
        # low-communication mode: the node's own rule (its round is due, or it is the single server) replaces the
        # target and the settle rule; then this peer's round begins once the swarm's samples stopped growing
        self.round_due = round_due
        self.on_swarm_epoch = on_swarm_epoch  # called with the swarm's epoch at every read of its progress
        self._seen_samples, self._grew_at = 0, time.monotonic()
        # the epoch at which every other peer the round counts said its round is due (the last read), if any
        self._others_due_at: Optional[int] = None
        self._due_at: Optional[int] = None  # the epoch at which this node's round is due (`round_is_due`)
        # epoch -> the other peers the last read at that epoch counted (the last two epochs), and the peers counted
        # for this peer's last round that were not in its group (`round_went`)
        self._counted: dict[int, frozenset[str]] = {}
        self._missing: tuple[int, frozenset[str]] = (-1, frozenset())
        # no round before this many reads of the swarm's progress, until when (`read_before_next_round`)
        self._reads, self._read_wait = 0, (0, 0.0)
        self._parsed: tuple[int, Optional[GlobalTrainingProgress]] = (0, None)  # (_reads, what that read parsed)
        super().__init__(*args, **kwargs)

    @property
    def ready_to_update_epoch(self) -> bool:
        if self.global_epoch > self.local_progress.epoch:
            return True
        reads, until = self._read_wait
        if self._reads < reads and time.monotonic() < until:
            return False
        progress = self.global_progress
        samples = progress.samples_accumulated
        if samples != self._seen_samples:
            self._seen_samples, self._grew_at = samples, time.monotonic()
        if self.round_due is not None:
            # every node stops its inner updates when they are done: once the swarm's samples stop growing, every
            # node in it is waiting for this round (a node that left stops counting when its record expires)
            others_due = self._others_due_at == self.local_progress.epoch
            return self.round_due() and (not self.others_present() or others_due
                                         or time.monotonic() - self._grew_at >= self.settle_s)
        if samples >= self.target_batch_size and (progress.num_peers > 1 or not self.others_present()):
            return True
        return samples > 0 and time.monotonic() - self._grew_at >= self.settle_s

    def _parse_swarm_progress_data(self, metadata) -> GlobalTrainingProgress:
        progress = super()._parse_swarm_progress_data(metadata)
        if isinstance(metadata, dict) and metadata:
            announced, downloading, ended = self.announced_epochs(), self.downloading(), self.ended()
            others = [LocalTrainingProgress.parse_obj(v.value) for key, v in metadata.items()
                      if v.value is not None and key != self._local_public_key]
            epoch, (missing_at, missing) = progress.epoch, self._missing
            at_epoch, late = [], []  # the peers the round counts (the class docstring)
            for p in others:
                name = _peer_name(p.peer_id)
                if max(downloading.get(name, float("-inf")), ended.get(name, float("-inf"))) >= p.time:
                    continue  # the newest word of it: it downloads the state, or its process ended
                if p.epoch >= epoch or announced.get(name, -1) >= epoch:
                    at_epoch.append(p)
                elif (p.epoch == epoch - 1 and p.samples_per_second == 0.0
                      and not (missing_at == p.epoch and name in missing)):
                    late.append(p)  # one epoch behind, its round due: it catches up
            current = at_epoch + late
            counted = frozenset(_peer_name(p.peer_id) for p in current)  # one assignment: read by the node's thread
            self._counted = {**{e: names for e, names in self._counted.items() if e == epoch - 1}, epoch: counted}
            # this peer by what it knows of itself, not by its record (hivemind may have stopped publishing it, as
            # above): left out of its own count, a full peer found itself alone with a client and began no round
            if self._local_public_key in metadata and self.local_progress.epoch >= progress.epoch:
                current.append(self.local_progress)
            progress.num_peers, progress.num_clients = len(current), sum(p.client_mode for p in current)
            # a peer counted late is due by what made it count
            due = bool(at_epoch or late) and all(p.epoch == epoch and p.samples_per_second == 0.0 for p in at_epoch)
            self._others_due_at = progress.epoch if due else None
        else:
            self._others_due_at = None
        self._reads += 1
        self._parsed = (self._reads, progress)  # hivemind makes it global_progress as this returns
        self.on_swarm_epoch(progress.epoch)
        if self.round_due is not None and not self.round_due():
            progress.next_fetch_time = max(progress.next_fetch_time, get_dht_time() + self.between_rounds_s)
        return progress

    def _get_local_progress(self, local_epoch: int, samples_accumulated: int) -> LocalTrainingProgress:
        progress = super()._get_local_progress(local_epoch, samples_accumulated)
        if self._due_at == local_epoch:  # trains no more in this epoch (above); the next epoch's record is as usual
            progress = progress.copy(update=dict(samples_per_second=0.0))
        return progress

    def round_is_due(self) -> None:
        """This node's round is due in its epoch (low-comm; called whenever the node finds it so, once per epoch
        counts): its record says so at once (a rate of 0), and the swarm's progress is read now, not at the pace
        between rounds. (hivemind's fetcher waits on `global_state_updated` until `next_fetch_time`; woken, it waits
        again for the time left, none.)"""
        local = self.local_progress
        if self._due_at == local.epoch:
            return
        self._due_at = local.epoch
        self.report_local_progress(local.epoch, local.samples_accumulated)
        self.read_now()

    def read_now(self) -> None:
        """The swarm's progress is read now, not at the pace between rounds (hivemind's fetcher waits on
        `global_state_updated` until `next_fetch_time`; woken, it waits again for the time left, none). A joiner
        waits for this read before it decides how to take the state (node.swarm.swarm.Swarm.wait_for_progress):
        left to the pace between rounds, it comes up to `between_rounds_s` after the tracker's first read, which is
        made as the tracker starts and does not count as a fetch."""
        self.global_progress.next_fetch_time = get_dht_time()
        self.global_state_updated.set()

    def round_went(self, epoch: int, group: Iterable[str]) -> None:
        """This peer's round at `epoch` averaged with `group` (peer ids): the peers the round counted that are not in
        it are not counted as one epoch behind in the next (see the class docstring)."""
        self._missing = (epoch, self._counted.get(epoch, frozenset()) - set(group))

    def read_before_next_round(self) -> None:
        """This peer's round gave it no update, or it brought its state to a later epoch itself (a download, a
        replay). Its last read of the swarm's progress is from before: the swarm may have moved on meanwhile (a
        peer's update alone, the others' round without it), and after a replay a peer still catching up to the new
        epoch was left out of the count. Begun on that read, its next round looked, for the whole matchmaking
        deadline, for a group at an epoch nobody is at, or closed without that peer and left it behind the swarm.
        So no round of this peer begins before the swarm's progress was read again (now; for at most
        READ_WAIT_S), by a read that began after this call: one already on its way (it holds the progress lock)
        may carry what the swarm looked like before."""
        in_flight = self.lock_global_progress.locked()
        self._read_wait = (self._reads + 1 + in_flight, time.monotonic() + READ_WAIT_S)
        self.read_now()

    def others_counted(self, epoch: int) -> int:
        """How many other peers the last read at `epoch` counted for its round (this one left out: a read made just
        after this node's state came may not hold its own record yet)."""
        return len(self._counted.get(epoch, ()))

    def fresh_progress(self, timeout_s: float) -> Optional[GlobalTrainingProgress]:
        """The swarm's progress by the read `read_before_next_round` asked for, once it came (waited for at most
        `timeout_s`); None if it did not come by then. After a download or a replay the read from before shows the
        swarm as it was before this node's state came: at an earlier epoch, or without this node in the count."""
        reads, _ = self._read_wait
        deadline = time.monotonic() + timeout_s
        while (parsed := self._parsed)[0] < reads:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return parsed[1]

    @property
    def estimated_next_update_time(self) -> float:
        # no estimate, so hivemind never pre-schedules a round for a time the bridge's traffic cannot promise
        return get_dht_time() if self.ready_to_update_epoch else float("inf")


def _peer_name(peer_id: bytes) -> str:
    try:
        return PeerID(peer_id).to_base58()
    except Exception:  # a record that names no peer counts by its epoch alone
        return ""
