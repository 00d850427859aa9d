"""The sparse swarm's last outer rounds, kept so that a node a few rounds behind replays them instead of downloading
the whole state (docs/low-communication.md, "Catching up over a slow link").

With `--wire-codec sparse` a node's outer update is a function of the round's members' payloads alone: the same
payloads, the same average, the same outer Nesterov step, the same bits on every node (node.lowcomm.gather). So a
node that holds the state of epoch e (parameters and outer momentum) and the records of rounds e+1..E (every
member's payload and weight: node.lowcomm.record) computes the state of epoch E exactly, for what the rounds' members
received (0.33 bytes per model element per member at top-0.2) instead of the parameters and the momentum (5 bytes
per parameter); it replays only while that is the smaller. Every node keeps the records of its last MAX_ROUNDS
outer updates and serves them (LOG_HANDLER); a node behind asks a peer that serves the swarm's epoch, applies them,
and serves the result only if its digest is what the peers publish for that epoch. Anything else (a gap in the log,
a peer that does not answer, another digest) falls back to the full download.

Wire format of an answer (little-endian): for each round, u64 epoch, u32 byte count, then its record; rounds in
increasing epoch order, each one epoch after the one before.
"""
from __future__ import annotations

import asyncio
import contextlib
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from typing import AsyncIterator, BinaryIO, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence

import torch
from google.protobuf import wrappers_pb2
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.logging import get_logger

from dtrain.node.lowcomm import momentum as momentum8
from dtrain.node.lowcomm import record, sparse
from dtrain.node.lowcomm.roundfiles import RoundFiles
from dtrain.node.snapshot import params_digest
from dtrain.node.swarm.agreement import reference_of
from dtrain.node.swarm.deadlines import Deadline, round_deadline

logger = get_logger(__name__)

LOG_HANDLER = "dtrain.lowcomm.round_records"
MAX_ROUNDS = 16  # rounds a node keeps, and the most a node behind replays
CHUNK_BYTES = 1 << 20
MAX_DONORS = 3  # peers asked for their log before the node downloads the state instead
COLLECT_EVERY_S = 2.0  # while a node downloads the state, how often it fetches the rounds made meanwhile
COLLECT_STATES = 2.0  # it collects at most this many times the state's bytes of rounds
COLLECT_LOOK_BACK = 3  # epochs below the swarm's it looks at for the newest one peers publish their bytes of
FETCH_TIMEOUT_S = 120.0  # the least one answer may take; more when its bytes need it at --link-mbit
RECORD_WAIT_S = 10.0  # how long a replay waits for the peers' records of the epoch it catches up to
RECORD_POLL_S = 0.5
REQUEST = struct.Struct("<QI")  # the last epoch the asker holds, how many rounds it wants after it
FRAME = struct.Struct("<QI")  # a round's epoch, its payload's bytes


class BadRoundLog(ValueError):
    """An answer that is not the rounds asked for, in this format, for a model of this size."""


STATE_BYTES_PER_ELEMENT = momentum8.STATE_BYTES_PER_ELEMENT  # a download: f32 parameters, 8-bit outer momentum


def fetch_timeout(count: int, peers: int, fraction: float, total: int, link_mbit: float) -> Deadline:
    """How long an answer of `count` rounds may take: 3x their bytes at `link_mbit`, never under FETCH_TIMEOUT_S.
    (A fixed 120 s cut GPT-2 small's rounds behind 20 Mbit/s, and the node downloaded the whole state instead.)"""
    return round_deadline(count * record.bytes_per_element(peers, fraction) * total, FETCH_TIMEOUT_S, link_mbit)


def member_limit(sizes: Sequence[int], fraction: float) -> int:
    """Elements one member's payload in a record may carry: a top-k offer of a model of `sizes`."""
    return sparse.max_kept(sizes, fraction)


class OnDisk:
    """Bytes kept in an unlinked temporary file (in TMPDIR, or the system's temporary directory), read back by
    length and slice: a log of rounds then costs the kernel's page cache, which it writes out and drops under
    pressure, not the node's memory (up to 2P; a GPT-2 medium round between two nodes is about 0.6 GB). The file
    goes with the last reference to it."""

    def __init__(self, data: bytes = b"", write: Optional[Callable[[BinaryIO], int]] = None):
        """`data`, or what `write` writes to the file (returning its size)."""
        self._file = tempfile.TemporaryFile(prefix="dtrain-round-")
        self._size = write(self._file) if write is not None else self._file.write(data)
        self._file.flush()

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, key: slice) -> bytes:
        start, stop, step = key.indices(self._size)
        if step != 1:
            raise ValueError("only contiguous slices")
        return record.pread_all(self._file.fileno(), max(0, stop - start), start)

    def __bytes__(self) -> bytes:
        return self[:]


class RoundLog:
    """The records of this node's last outer updates, by the epoch each one made (thread-safe): at most
    `max_rounds`, and the newest rounds whose payloads fit in `max_bytes` (a node behind by more bytes of rounds
    than the state's downloads the state instead, so an older round would be held for nobody). Each round's bytes
    are kept on disk (`OnDisk`); an answer reads them back in pieces."""

    def __init__(self, max_rounds: int = MAX_ROUNDS, max_bytes: Optional[int] = None):
        self._rounds: OrderedDict[int, OnDisk] = OrderedDict()
        self._max, self._max_bytes = max_rounds, max_bytes
        self._bytes = 0
        self._lock = threading.Lock()

    def add(self, epoch: int, entry: bytes | OnDisk) -> None:
        entry = entry if isinstance(entry, OnDisk) else OnDisk(entry)
        with self._lock:
            if self._rounds and epoch <= next(reversed(self._rounds)):
                self._clear()  # the node went back (a download of an older epoch): the log starts again
            self._rounds[epoch] = entry
            self._bytes += len(entry)
            while len(self._rounds) > self._max or (self._max_bytes is not None and self._bytes > self._max_bytes):
                self._bytes -= len(self._rounds.popitem(last=False)[1])

    def after(self, epoch: int, count: int) -> list[tuple[int, OnDisk]]:
        """Rounds epoch+1, epoch+2, ... up to `count` of them, as far as the log holds them without a gap (their
        bytes stay readable while the list is held, whatever the log drops meanwhile)."""
        out = []
        with self._lock:
            for e in range(epoch + 1, epoch + 1 + min(count, self._max)):
                if e not in self._rounds:
                    break
                out.append((e, self._rounds[e]))
        return out

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self._rounds.clear()
        self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._rounds)

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes


def frame(rounds: Sequence[tuple[int, bytes | OnDisk]]) -> bytes:
    return b"".join(frames(rounds))


def frames(rounds: Sequence[tuple[int, bytes | OnDisk]], chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The answer for `rounds` in pieces of at most `chunk` bytes, without a copy of the whole answer (GPT-2
    small's round is about 200 MB)."""
    for epoch, data in rounds:
        yield FRAME.pack(epoch, len(data))
        for i in range(0, len(data), chunk):
            yield data[i:i + chunk]


class Round(NamedTuple):
    epoch: int
    record: bytes | OnDisk  # as it came, to be kept and served again
    members: list[record.Member]

    def average_into(self, out: Sequence[torch.Tensor], total: int, limit: int) -> None:
        """The round's average in `out` (node.lowcomm.record.average_into)."""
        record.average_into(self.record, self.members, out, total, limit)


def unframe(data: bytes, after: int, count: int, total: int, limit: int) -> list[Round]:
    """Each round of an answer to (after, count), every record checked down to its payloads' headers (`limit`: the
    elements of a member's payload, `member_limit`)."""
    rounds, offset = [], 0
    while offset < len(data):
        if len(data) - offset < FRAME.size:
            raise BadRoundLog(f"a truncated round header at byte {offset}")
        epoch, size = FRAME.unpack_from(data, offset)
        offset += FRAME.size
        if epoch != after + 1 + len(rounds) or len(rounds) >= count:
            raise BadRoundLog(f"round {epoch} where {after + 1 + len(rounds)} (of {count} after {after}) was due")
        if size > len(data) - offset:
            raise BadRoundLog(f"round {epoch} claims {size} bytes, {len(data) - offset} left")
        raw = data[offset:offset + size]
        try:
            members = record.parse(raw, total, limit)
        except record.BadRecord as e:
            raise BadRoundLog(f"round {epoch}: {e}") from None
        rounds.append(Round(epoch, raw, members))
        offset += size
    return rounds


def max_answer_bytes(count: int, total: int, limit: int) -> int:
    return count * (FRAME.size + record.max_bytes(record.MAX_MEMBERS, total, limit))


def handler(log: RoundLog):
    """The LOG_HANDLER protobuf handler serving `log` (streamed in chunks)."""
    async def serve(request: wrappers_pb2.BytesValue, context: P2PContext) -> AsyncIterator[wrappers_pb2.BytesValue]:
        if len(request.value) != REQUEST.size:
            return
        after, count = REQUEST.unpack(request.value)
        for piece in frames(log.after(after, count)):
            yield wrappers_pb2.BytesValue(value=piece)
    return serve


async def fetch(p2p: P2P, peer: PeerID, after: int, count: int, max_bytes: int, timeout_s: float) -> bytes:
    """The raw answer of `peer` to (after, count) within `timeout_s`; BadRoundLog once it streams more than
    `max_bytes`."""
    async def receive() -> bytes:
        request = wrappers_pb2.BytesValue(value=REQUEST.pack(after, count))
        stream = await p2p.iterate_protobuf_handler(peer, LOG_HANDLER, request, wrappers_pb2.BytesValue)
        chunks, size = [], 0
        async for message in stream:
            size += len(message.value)
            if size > max_bytes:
                raise BadRoundLog(f"{peer} sent more than {max_bytes} bytes for {count} rounds")
            chunks.append(message.value)
        return b"".join(chunks)

    return await asyncio.wait_for(receive(), timeout_s)


@torch.no_grad()
def replay(params: Sequence[torch.Tensor], outer: torch.optim.Optimizer, rounds: Sequence[Round], limit: int) -> None:
    """Apply each round's average to `params` with the outer optimizer, as the swarm's update did: the average in
    `.grad`, one outer (never passthrough) step from the parameters as they are (no round's source).
    sparse.BadPayload for a member's payload the codec refuses (the parameters are then part-way)."""
    grads = [p.grad for p in params]
    total = sum(p.numel() for p in params)
    passthrough, source = getattr(outer, "passthrough", False), getattr(outer, "source", None)
    outer.passthrough, outer.source = False, None
    try:
        for r in rounds:
            r.average_into(grads, total, limit)
            outer.step()
    finally:
        outer.passthrough, outer.source = passthrough, source


def missing(have: int, want: int, collected: Iterable[int]) -> list[tuple[int, int]]:
    """The rounds `have`+1..`want` not among the `collected` epochs, as (after, count) runs to ask a log for."""
    held, runs, epoch = set(collected), [], have
    while epoch < want:
        if epoch + 1 in held:
            epoch += 1
            continue
        end = next((e for e in range(epoch + 1, want + 1) if e in held), want + 1)
        runs.append((epoch, end - 1 - epoch))
        epoch = end - 1
    return runs


class CatchUp:
    """A sparse node's round log, filled after each of its outer updates (averaged, or its own after a failed
    round) and served to its peers, and its own catch-up by replay, with the rounds it collected while it downloaded
    the state (`collecting`). A download of the state empties the log: the updates before it were this node's, not
    necessarily the swarm's. `swarm` is the node's node.swarm.swarm.Swarm, `agreement` its
    node.swarm.agreement.Agreement."""

    def __init__(self, swarm, agreement, model: torch.nn.Module, fraction: float, link_mbit: float = 0.0):
        self._link_mbit = link_mbit
        self._swarm, self._agreement, self._model = swarm, agreement, model
        self._params = list(model.parameters())
        self._total = sum(p.numel() for p in self._params)
        self.log = RoundLog(max_bytes=int(STATE_BYTES_PER_ELEMENT * self._total))
        self._limit = member_limit([p.numel() for p in self._params], fraction)
        self._fraction = fraction
        self._files: RoundFiles = swarm.optimizer.grad_averager.round_files  # node.lowcomm.roundfiles
        self._pending: Optional[OnDisk] = None
        self._collected: dict[int, Round] = {}  # rounds fetched while the node downloaded (`collecting`)
        self._collected_lock = threading.Lock()
        swarm.service.add_handler(LOG_HANDLER, handler(self.log), wrappers_pb2.BytesValue, stream_output=True)
        swarm.optimizer.before_update = self._stash
        swarm.optimizer.on_state_loaded = self.forget
        swarm.optimizer.node_catches_up = True  # SwarmFollower.catch_up: a replay, else a checked download

    def _stash(self) -> None:
        """The record of what the outer step is about to apply: the round's, when .grad holds its average, else this
        node's own offer as a record of one member (none for a node alone, which applies its pseudo-gradient as it
        is: its inner updates are the spec's updates, which no record describes)."""
        opt = self._swarm.optimizer
        self._pending = None
        if getattr(opt.state_averager.optimizer, "passthrough", False):
            return
        offer = self._files.offer()
        if offer is None:
            logger.warning("An outer update with no sparse offer of this node: no round log holds it")
            return
        if len(opt.round_group) <= 1:
            self._pending = OnDisk(record.encode([(1.0, offer)]))
            return
        entry = OnDisk(write=self._files.copy_record)
        try:
            members = record.parse(entry, self._total, self._limit)
        except record.BadRecord as e:
            logger.warning(f"The round's record is not one: {e}; no round log holds this update")
            return
        if not any(m.length == len(offer) and entry[m.offset:m.offset + m.length] == offer for m in members):
            logger.warning("The averager's last record is of another round (this node's offer is not in it); no "
                           "round log holds this update")
            return
        self._pending = entry

    def record(self, outcome) -> None:
        """After an outer update: keep what it applied under the epoch it made."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.log.add(outcome.epoch, pending)

    def forget(self) -> None:
        self._pending = None
        self.log.clear()

    def replay(self) -> bool:
        """Bring the parameters (at the anchor: the served bytes of the node's epoch) and the outer momentum to the
        swarm's epoch with the rounds collected during a download (`collecting`) and the rest from a peer's log, only
        the runs of rounds it did not collect (`missing`); True when the result is the bytes the peers publish for
        that epoch. False leaves the parameters anywhere: the caller downloads the state."""
        opt = self._swarm.optimizer
        have, want = opt.local_epoch, self._agreement.saw(opt.tracker.global_epoch)
        with self._collected_lock:  # what is collected up to the node's epoch is of no more use
            self._collected = {e: r for e, r in self._collected.items() if e > have}
            collected = dict(self._collected)
        if want - have <= 0:
            return False
        # the swarm's newest epoch may still be in the making (no record yet): then the one before, if it is ahead.
        # One epoch behind, that leaves none: its records are waited for (RECORD_WAIT_S), as a read over a link that a
        # download has just filled may not find them yet, before the node downloads the whole state instead
        newest, deadline = want, time.monotonic() + RECORD_WAIT_S
        while True:
            for want in (newest, newest - 1):
                records = self._agreement.records(want)
                found = reference_of(records)
                if found is not None or want - 1 <= have:
                    break
            if found is not None or time.monotonic() >= deadline:
                break
            time.sleep(RECORD_POLL_S)
        if found is None:
            logger.info(f"No peer publishes its bytes for epoch {want} within {RECORD_WAIT_S:g}s: nothing to check a "
                        f"replay against")
            return False
        gaps = missing(have, want, collected)
        count, digest = sum(n for _, n in gaps), found[1].digest
        peers = max(2, opt.tracker.global_progress.num_peers)
        if count > MAX_ROUNDS:  # more than the peers' logs hold
            return False
        if count * record.bytes_per_element(peers, self._fraction) >= STATE_BYTES_PER_ELEMENT:
            logger.info(f"{count} rounds behind among {peers} peers at top-{self._fraction:g}: downloading the state "
                        f"costs less than replaying them")
            return False
        began, fetched, source = time.monotonic(), {}, ""
        for after, n in gaps:
            got, source = self.fetch_rounds(self._donors(records, digest), after, n, peers)
            if got is None:
                return False
            fetched.update((r.epoch, r) for r in got)
        rounds = [collected.get(e) or fetched[e] for e in range(have + 1, want + 1)]
        try:
            replay(self._params, opt.state_averager.optimizer, rounds, self._limit)
        except sparse.BadPayload as e:  # the parameters are part-way: downloaded instead
            logger.warning(f"A round holds a payload the codec refuses ({e}); downloading the state")
            return self._refused()
        if params_digest(self._model) != digest:
            logger.warning(f"Replaying rounds {have + 1}..{want} did not give the bytes the swarm serves for "
                           f"epoch {want}; downloading the state")
            return self._refused()
        adopt_epoch(opt, want)
        for r in rounds:  # verified by the digest: this node serves them too from now on
            self.log.add(r.epoch, r.record)
        moved, ahead = sum(len(r.record) for r in fetched.values()) / 1e6, len(rounds) - len(fetched)
        logger.info(f"Caught up from epoch {have} to {want} by replaying {len(rounds)} rounds"
                    + (f" ({ahead} collected while it downloaded)" if ahead else "")
                    + (f" from {source}: {moved:.2f} MB" if fetched else "")
                    + f" in {time.monotonic() - began:.1f}s instead of the whole state")
        return True

    def _refused(self) -> bool:
        """A replay that did not give the swarm's bytes: no later one uses the rounds collected for it."""
        with self._collected_lock:
            self._collected.clear()
        return False

    def _donors(self, records, digest: str) -> list[str]:
        """The full peers whose `records` say they serve `digest`, by their state-sharing priority, highest first."""
        return [peer for peer, r in sorted(records.items(), key=lambda item: -item[1].priority)
                if r.digest == digest and not r.client and peer != self._swarm.peer_id]

    def fetch_rounds(self, donors: Sequence[str], after: int, count: int, peers: int,
               some: bool = False) -> tuple[Optional[list[Round]], str]:
        """The `count` rounds after epoch `after` (`some`: as many of them as a donor holds, at least one) from the
        first MAX_DONORS of `donors` that answers with them: (the rounds, the donor), or (None, "")."""
        timeout = fetch_timeout(count, peers, self._fraction, self._total, self._link_mbit)
        say = logger.debug if some else logger.info  # collecting asks every few seconds
        for donor in donors[:MAX_DONORS]:
            try:
                data = self._swarm.service.run(fetch(
                    self._swarm.service.p2p, PeerID.from_base58(donor), after, count,
                    max_answer_bytes(count, self._total, self._limit), timeout.seconds), timeout.seconds + 5.0)
                rounds = unframe(data, after, count, self._total, self._limit)
            except Exception as e:  # no answer, a timeout, a malformed log: the next donor, then the download
                say(f"No round log from {donor} (within {timeout.seconds:.0f}s, from {timeout.why}): {e!r}")
                continue
            if len(rounds) == count or (some and rounds):
                return rounds, donor
            say(f"{donor} holds {len(rounds)} of the {count} rounds after epoch {after}")
        return None, ""

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """While the caller downloads the state: the records of the rounds the swarm makes meanwhile, asked every
        COLLECT_EVERY_S, from the swarm's epoch as the download begins (the one a donor serves; a donor still at the
        epoch before serves that, and the replay asks a log for the round in between), for the replay that follows. A
        download that takes longer than the rounds the peers' logs hold lands behind them; without these, the node
        downloads again and lands as far behind, with no end. They are asked of the peers of lowest state-sharing
        priority first (the download is from the highest: over a saturated link, a request on the same connection
        waits behind the state), and checked as any replay: by the digest the result must have."""
        done = threading.Event()
        with self._collected_lock:
            self._collected.clear()
        opt = self._swarm.optimizer
        want = self._agreement.saw(opt.tracker.global_epoch)
        donors = []
        for epoch in range(want, max(0, want - COLLECT_LOOK_BACK), -1):  # on fast rounds the records lag the epoch
            found = reference_of(records := self._agreement.records(epoch))
            if found is not None:
                donors = self._donors(records, found[1].digest)[::-1]
                break
        thread = threading.Thread(target=self._collect, args=(want, donors, done),
                                  name="dtrain-collect-rounds", daemon=True)
        if donors:
            thread.start()
        try:
            yield
        finally:
            done.set()
            with self._collected_lock:
                collected = sorted(self._collected)
                held = sum(len(self._collected[e].record) for e in collected)
            if collected:
                logger.info(f"Collected rounds {collected[0]}..{collected[-1]} ({held / 1e6:.2f} MB) while downloading")

    def _collect(self, after: int, donors: list[str], done: threading.Event) -> None:
        opt, held = self._swarm.optimizer, 0
        budget = COLLECT_STATES * STATE_BYTES_PER_ELEMENT * self._total
        while not done.wait(COLLECT_EVERY_S):
            try:  # whatever the peers' logs hold after the last round collected
                peers = max(2, opt.tracker.global_progress.num_peers)
                rounds, _ = self.fetch_rounds(donors, after, MAX_ROUNDS, peers, some=True)
            except Exception as e:  # the download goes on; the replay after it fetches what is missing
                logger.debug(f"Collecting rounds after epoch {after} failed: {e!r}")
                continue
            if not rounds:
                continue
            with self._collected_lock:
                if done.is_set():
                    return
                for r in rounds:  # on disk, as the log keeps them
                    self._collected[r.epoch] = Round(r.epoch, OnDisk(r.record), r.members)
            held, after = held + sum(len(r.record) for r in rounds), rounds[-1].epoch
            if held >= budget:
                logger.info(f"Collected {held / 1e6:.1f} MB of rounds while downloading, {COLLECT_STATES:g}x the "
                            f"state's bytes: no more")
                return


def adopt_epoch(opt, epoch: int) -> None:
    """After the node itself brought its state to `epoch` (a replay, a download in ranges): what hivemind does after
    a download (Optimizer.load_state_from_peers). `opt` is the node's SwarmOptimizer."""
    opt.state_averager.local_epoch = epoch
    opt.tracker.report_local_progress(local_epoch=epoch, samples_accumulated=0)
    opt.grad_averager.reset_accumulated_grads_()
    if not opt.client_mode:
        opt.state_averager.state_sharing_priority = epoch
        opt.grad_averager.state_sharing_priority = epoch
    opt.tracker.read_before_next_round()  # its last read saw the swarm from an earlier epoch
