"""A joiner's first download of a sparse swarm's state, spread over several donors and resumable
(docs/low-communication.md, "Joining from several donors"); `--state-donors N`.

Donor: `RangeDonor` answers RANGE_HANDLER requests for ranges (node.lowcomm.ranges) of the state it serves, gated by
the swarm key like the node's other RPCs: the parameters of the published snapshot (immutable) and the outer
momentum of the same epoch (its 8-bit codes and scales: node.lowcomm.momentum), read from the optimizer's own
tensors, with no copy of them. The outer optimizer's version (lowcomm.outer.OuterNesterov.version) says when the
momentum is still that epoch's: a range copied between two reads of the same even version, the one of the
snapshot's publication, is one epoch's bytes. Once the next outer step (or a download) has moved it, an answer waits
for the next published snapshot and serves that epoch's range. While joiners download (a range was asked for in the
last SERVING_S), each published epoch's momentum is copied at its publication (1.02 bytes per parameter, given back
when they stop), and answers go on through the next outer step: the donors of a swarm are in one round, so
otherwise every one of them answered nothing from its outer step until its next publication, seconds of every round
(3-5 s of the default model's 12-15 s rounds on two cores), and a joiner's link stood idle for that long each time.

Joiner: `SpreadDownload` asks up to N peers that serve the swarm's epoch for different ranges at once (IN_FLIGHT
requests each); a donor that fails, answers wrong or takes longer than RANGE_TIMEOUT_S for a range is dropped and its
ranges go to the others; what arrived is kept, and a pass with donors read afresh asks only for what is missing.
Ranges older than the newest one received, or than the epoch before the swarm's newest when the swarm moved on
meanwhile (the peers keep records of their last epochs only), are brought forward with the averages of the rounds in
between, from a donor's round log (node.lowcomm.roundlog); the state is kept only if its digest is the one the peers
publish for its epoch. Anything else (no donor, no log of the rounds in between, another digest) returns False, and the node
downloads the state as before, from one peer through hivemind.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter, deque
from typing import AsyncIterator, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch
from google.protobuf import wrappers_pb2
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.logging import get_logger

from dtrain.node.lowcomm import momentum as momentum8
from dtrain.node.lowcomm import ranges, roundlog
from dtrain.node.snapshot import params_digest
from dtrain.node.swarm.agreement import reference_of
from dtrain.node.swarm.download import UploadPace

logger = get_logger(__name__)

RANGE_HANDLER = "dtrain.lowcomm.state_range"
CHUNK_BYTES = 1 << 18  # one message of an answer's stream
IN_FLIGHT = 3  # requests a joiner keeps open with each donor: a home link's round trip stays hidden
SERVING_S = 60.0  # a donor that answered a range this recently copies each epoch's momentum (module docstring)
RANGE_TIMEOUT_S = 30.0  # one range (512 KiB) at well under 1 Mbit/s: a donor slower than that loses its ranges
HOLD_WAIT_S = 10.0  # a donor's answer waits this long for the next epoch's snapshot once the momentum moved on
HOLD_POLL_S = 0.1
NOT_HELD_PAUSE_S = 1.0  # a donor that answered nothing (its state is moving) is asked again after this
NOT_HELD_LIMIT_S = 120.0  # ...until it has answered nothing else for this long: then it has failed
PASS_PAUSE_S = 1.0  # between two passes, when every donor of a pass failed
RECORD_WAIT_S = 10.0  # for the peers' records of the epoch the pieces are of
POLL_S = 2.0  # the joiner's thread looks at a pass this often (to keep announcing itself)
MAX_PASSES = 10  # passes (donors read afresh, missing or stale ranges asked again) before hivemind's download


class NoWholeAnswer(Exception):
    """A donor's answer that brought no whole range, for a reason that passes: the range is asked again
    (`fetch_ranges`)."""


class NotHeld(NoWholeAnswer):
    """A donor's empty answer: it holds no settled state of one epoch now (nothing published yet, or its outer step
    moved the momentum and the next snapshot did not come within its HOLD_WAIT_S)."""


class CutShort(NoWholeAnswer):
    """An answer whose stream ended before the range's bytes did: cut off in transit (a stream that its sender ends
    while its last bytes are still on a slow link's way can lose them: node.lowcomm.gather), not a wrong answer. A
    GPT-2 small donor behind 20 Mbit/s sent one chunk of a range and was dropped for it."""


class Held(NamedTuple):
    epoch: int
    params: tuple[np.ndarray, ...]  # per tensor, flat float32 (a snapshot's immutable copies)
    codes: tuple[np.ndarray, ...]  # per tensor, flat int8: views of the outer optimizer's live momentum codes
    scales: tuple[np.ndarray, ...]  # per tensor, float32: views of their live scales
    version: int  # the outer optimizer's version while the momentum is this epoch's
    copied: bool = False  # codes and scales are copies: this epoch's whatever the version says now


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if len(parts) != 1 else parts[0]


class RangeDonor:
    """Serves ranges of the state this node serves (see the module docstring); `hold` runs on the training thread
    after every published snapshot, the answers on the node service's loop."""

    def __init__(self, layout: ranges.StateLayout, service=None, serve_mbit: float = 0.0,
                 version: Callable[[], int] = lambda: 0, hold_wait_s: float = HOLD_WAIT_S,
                 serving_s: float = SERVING_S):
        """`layout`: the model's tensors. `service`: the node's node.swarm.service.NodeService, which then serves
        `serve` as RANGE_HANDLER (gated by the swarm key). `serve_mbit`: the bound on the bytes it streams, all
        requests together (0: none). `version`: the outer optimizer's version (OuterNesterov.version), even while
        nothing writes its momentum. `serving_s`: for this long after a range was asked for, each epoch's momentum is
        copied as it is published (0: never)."""
        self._layout = layout
        self._pace = UploadPace(serve_mbit)
        self._version, self._hold_wait_s, self._serving_s = version, hold_wait_s, serving_s
        self._held: Optional[Held] = None  # replaced whole, never changed
        self._asked_at = float("-inf")  # when a range was last asked for (monotonic)
        self.answered = 0  # ranges served
        if service is not None:
            service.add_handler(RANGE_HANDLER, self.serve, wrappers_pb2.BytesValue, stream_output=True)

    def serving(self) -> bool:
        """A range was asked for in the last `serving_s`: a joiner downloads from this node."""
        return time.monotonic() - self._asked_at < self._serving_s

    def hold(self, epoch: int, params: Sequence[np.ndarray], codes: Sequence[torch.Tensor],
             scales: Sequence[torch.Tensor]) -> None:
        """Serve epoch `epoch`: `params` are its snapshot's arrays, `codes` and `scales` the outer optimizer's
        momentum tensors, which hold this epoch's momentum now (read in place; copied while joiners download)."""
        flat_codes = tuple(c.detach().reshape(-1).numpy() for c in codes)
        flat_scales = tuple(s.detach().reshape(-1).numpy() for s in scales)
        sizes = list(self._layout.sizes)
        if [len(a) for a in params] != sizes or [len(c) for c in flat_codes] != sizes or \
                [len(s) for s in flat_scales] != [momentum8.blocks(n) for n in sizes]:
            raise ValueError(f"a state of {sum(len(a) for a in params)} parameters and "
                             f"{sum(len(c) for c in flat_codes)} momentum codes, not this model's "
                             f"{self._layout.total} in its tensors")
        version = self._version()
        if self.serving() and version % 2 == 0:
            copies = (tuple(c.copy() for c in flat_codes), tuple(s.copy() for s in flat_scales))
            if self._version() == version:  # nothing wrote the momentum meanwhile: one epoch's bytes
                self._held = Held(epoch, tuple(params), *copies, version, copied=True)
                return
            version = self._version()
        self._held = Held(epoch, tuple(params), flat_codes, flat_scales, version)

    def piece(self, r: ranges.Range) -> Optional[ranges.Piece]:
        """Range `r` of the epoch held, while the momentum is still that epoch's; else None."""
        held = self._held
        if held is None or not self._settled(held):
            return None
        parts = self._layout.parts(r)
        codes = _joined([held.codes[t][lo:hi] for t, lo, hi in parts]).copy()
        scales = _joined([held.scales[part.tensor][part.first_scale:part.end_scale] for part in parts]).copy()
        if not self._settled(held):  # an outer step began while it was copied
            return None
        return ranges.Piece(held.epoch, _joined([held.params[t][lo:hi] for t, lo, hi in parts]), codes, scales)

    def _settled(self, held: Held) -> bool:
        """`held`'s codes and scales are its epoch's: copies, or the live tensors while no step has moved them."""
        return held.copied or (held.version % 2 == 0 and self._version() == held.version)

    async def serve(self, request: wrappers_pb2.BytesValue,
                     context: P2PContext) -> AsyncIterator[wrappers_pb2.BytesValue]:
        try:
            r = self._layout.parse_request(request.value)
        except ranges.BadRange as e:
            logger.debug(f"Refused a range request from {context.remote_id}: {e}")
            return
        self._asked_at = time.monotonic()
        deadline = time.monotonic() + self._hold_wait_s
        while (piece := self.piece(r)) is None:  # nothing held yet, or the momentum moved: the next epoch's snapshot
            if time.monotonic() >= deadline:
                return  # an empty answer: the joiner asks another donor
            await asyncio.sleep(HOLD_POLL_S)
        data = ranges.encode_piece(r, piece)
        self.answered += 1
        for i in range(0, len(data), CHUNK_BYTES):
            chunk = data[i:i + CHUNK_BYTES]
            await self._pace.spend(len(chunk))
            yield wrappers_pb2.BytesValue(value=chunk)


async def fetch_range(p2p: P2P, peer: PeerID, layout: ranges.StateLayout, r: ranges.Range, min_epoch: int,
                      max_epoch: int, timeout_s: float) -> ranges.Piece:
    """One range from `peer`, checked (StateLayout.decode_piece); BadRange once it streams more than the range's
    bytes."""
    limit = layout.answer_bytes(r)

    async def receive() -> bytes:
        request = wrappers_pb2.BytesValue(value=ranges.encode_request(r))
        stream = await p2p.iterate_protobuf_handler(peer, RANGE_HANDLER, request, wrappers_pb2.BytesValue)
        chunks, size = [], 0
        async for message in stream:
            size += len(message.value)
            if size > limit:
                raise ranges.BadRange(f"{peer} sent more than the {limit} bytes of range {r.offset}+{r.length}")
            chunks.append(message.value)
        if not size:
            raise NotHeld(f"{peer} holds no settled state of one epoch now")
        if size < limit:
            raise CutShort(f"{size} of the {limit} bytes of range {r.offset}+{r.length} came from {peer}")
        return b"".join(chunks)

    return layout.decode_piece(await asyncio.wait_for(receive(), timeout_s), r, min_epoch, max_epoch)


async def fetch_ranges(p2p: P2P, layout: ranges.StateLayout, donors: Sequence[PeerID],
                       todo: Sequence[ranges.Range], min_epoch: int, max_epoch: int,
                       on_piece: Callable[[PeerID, ranges.Range, ranges.Piece], None],
                       in_flight: int = IN_FLIGHT, timeout_s: float = RANGE_TIMEOUT_S,
                       not_held_limit_s: float = NOT_HELD_LIMIT_S) -> dict[PeerID, str]:
    """Ask `donors` for the ranges of `todo`, `in_flight` at a time each, until every range came or every donor
    failed; a failed donor's range goes back for the others. Once nothing is left to ask, a donor with a free slot
    also asks for a range another donor is still sending (the first answer counts): a slow donor does not hold up
    the last ranges. A donor that answers nothing (NotHeld: its outer step is under way, which on a slow machine
    outlasts its wait for the next snapshot) or an answer cut short gives its range back and is asked again a moment
    later; it has failed once it answered nothing whole for `not_held_limit_s`. Returns the failed donors and why."""
    queue, failed = deque(todo), {}
    fetching: dict[ranges.Range, set] = {}  # range -> the donors asked for it, in the order they were asked
    done: set = set()
    moving: dict[PeerID, float] = {}  # donor -> since when it has answered nothing

    def give_back(r: ranges.Range, donor: PeerID) -> None:
        asked = fetching.get(r, set())
        asked.discard(donor)
        if not asked and r not in done:
            fetching.pop(r, None)
            queue.appendleft(r)

    async def worker(donor: PeerID) -> None:
        while donor not in failed:
            if queue:
                r = queue.popleft()
            else:
                spare = [r for r, asked in fetching.items() if len(asked) == 1 and donor not in asked]
                if not spare:
                    if not fetching:
                        return
                    await asyncio.sleep(0.05)
                    continue
                r = spare[0]  # the one asked longest ago
            asked = fetching.setdefault(r, set())
            asked.add(donor)
            try:
                piece = await fetch_range(p2p, donor, layout, r, min_epoch, max_epoch, timeout_s)
            except NoWholeAnswer as e:
                give_back(r, donor)
                since = moving.setdefault(donor, time.monotonic())
                if time.monotonic() - since >= not_held_limit_s:
                    failed.setdefault(donor, f"{e!r} for {not_held_limit_s:.0f}s")
                else:
                    await asyncio.sleep(NOT_HELD_PAUSE_S)
                continue
            except Exception as e:  # no answer, a timeout, a wrong answer: the range goes to another donor
                failed.setdefault(donor, repr(e))
                give_back(r, donor)
                continue
            moving.pop(donor, None)
            asked.discard(donor)
            if r not in done:
                done.add(r)
                fetching.pop(r, None)
                on_piece(donor, r, piece)

    await asyncio.gather(*(worker(d) for d in donors for _ in range(in_flight)))
    return failed


class SpreadDownload:
    """A joiner's download of the swarm's state from up to `max_donors` donors at once (the module docstring).
    `swarm` is the node's node.swarm.swarm.Swarm, `agreement` its node.swarm.agreement.Agreement; `announce` is
    called every few seconds while it downloads (the node's presence, so its peers make rounds meanwhile)."""

    def __init__(self, swarm, agreement, model: torch.nn.Module, catchup: roundlog.CatchUp, fraction: float,
                 max_donors: int, stop: threading.Event, announce: Callable[[], None] = lambda: None):
        self._swarm, self._agreement, self._model, self._catchup = swarm, agreement, model, catchup
        self._params = list(model.parameters())
        self._total = sum(p.numel() for p in self._params)
        self._limit = roundlog.member_limit([p.numel() for p in self._params], fraction)
        self._max_donors, self._stop, self._announce = max_donors, stop, announce
        outer = swarm.optimizer.state_averager.optimizer
        self._outer = outer
        self._lr, self._mu = outer.param_groups[0]["lr"], outer.param_groups[0]["momentum"]
        self.assembly = ranges.Assembly(ranges.StateLayout(p.numel() for p in self._params))
        self.sources: Counter = Counter()  # ranges received per donor
        self._progress_at = 0.0  # when the last range came (monotonic)

    def run(self, timeout_s: float) -> bool:
        """Download, bring forward, check; True when the model and the outer momentum hold the state the peers
        publish for its epoch (the optimizer's epoch set to it). Gives up after `timeout_s` without a new range: a
        large state over a slow link takes longer than that, and goes on while it makes progress."""
        opt = self._swarm.optimizer
        opt.state_averager.allow_state_sharing = False  # its tensors are about to be overwritten
        began = self._progress_at = time.monotonic()
        for _ in range(MAX_PASSES):
            if self._stop.is_set() or time.monotonic() >= self._progress_at + timeout_s:
                return False
            swarm_epoch = self._swarm_epoch()
            donors = self._donors(swarm_epoch)
            deadline = time.monotonic() + RECORD_WAIT_S  # a read that found nothing on a busy host, or a full link
            while not donors and time.monotonic() < deadline and not self._stop.wait(0.5):
                donors = self._donors(swarm_epoch)
            if not donors:
                logger.info(f"No peer serves the swarm's epoch {swarm_epoch} for a download in ranges")
                return False
            if self.assembly.missing():
                self._pass(donors, swarm_epoch, timeout_s)
                if self.assembly.missing():
                    self._stop.wait(PASS_PAUSE_S)
                    continue
            # the swarm may have moved on past every piece while they came (a large state over a slow link), past
            # the records the peers keep of their epochs: the pieces go to the epoch before the swarm's newest (which
            # may still be in the making), where the check finds its records, or else to their newest
            newest = self.assembly.newest()
            target = max(newest, self._swarm_epoch() - 1)
            oldest = self.assembly.oldest()
            if oldest < target and not self._bring_forward(target, donors) and \
                    oldest < newest and not self._bring_forward(newest, donors):
                dropped = self.assembly.drop_before(newest)
                logger.info(f"No round log brings the older ranges to epoch {newest}: downloading {dropped} again")
                continue
            checked = self._check(began)
            if checked is not None:
                return checked
        return False

    def _swarm_epoch(self) -> int:
        """The swarm's epoch, read now from the peers' progress records: the tracker's view lags behind a download
        that fills the link (a GPT-2 small joiner brought its ranges to an epoch two behind the swarm's, whose
        records had expired)."""
        opt = self._swarm.optimizer
        fresh = opt.read_swarm_epoch()
        return self._agreement.saw(max(opt.tracker.global_epoch, fresh if fresh is not None else -1))

    def _donors(self, swarm_epoch: int) -> list[PeerID]:
        """Full peers that serve the reference bytes of the swarm's epoch or of the one before (a peer still
        finishing the newest round serves the last one, which the round log brings forward), up to max_donors."""
        donors: list[str] = []
        for epoch in (swarm_epoch, swarm_epoch - 1):
            if epoch < 0:
                break
            records = self._agreement.records(epoch)
            found = reference_of(records)
            if found is None:
                continue
            donors += [peer for peer, r in sorted(records.items(), key=lambda item: -item[1].priority)
                       if r.digest == found[1].digest and r.served and not r.client
                       and peer != self._swarm.peer_id and peer not in donors]
        peers = []
        for p in donors[:self._max_donors]:
            try:
                peers.append(PeerID.from_base58(p))
            except ValueError:  # a record's subkey that names no peer
                continue
        return peers

    def _pass(self, donors: list[PeerID], swarm_epoch: int, timeout_s: float) -> None:
        todo = self.assembly.missing()
        lo, hi = max(0, swarm_epoch - roundlog.MAX_ROUNDS), swarm_epoch + roundlog.MAX_ROUNDS
        service = self._swarm.service

        def on_piece(donor: PeerID, r: ranges.Range, piece: ranges.Piece) -> None:
            self.assembly.add(r, piece)
            self._progress_at = time.monotonic()
            self.sources[str(donor)] += 1

        mb = sum(self.assembly.layout.answer_bytes(r) for r in todo) / 1e6
        logger.info(f"Downloading {len(todo)} ranges of the state ({mb:.1f} MB) "
                    f"from {len(donors)} donors: {', '.join(str(d) for d in donors)}")
        future = service.submit(fetch_ranges(service.p2p, self.assembly.layout, donors, todo, lo, hi, on_piece))
        while True:
            self._announce()
            try:
                failed = future.result(POLL_S)
                break
            except concurrent.futures.TimeoutError:
                if self._stop.is_set() or time.monotonic() >= self._progress_at + timeout_s:
                    future.cancel()
                    return
        for donor, why in failed.items():
            logger.info(f"Donor {donor} failed ({why}); its ranges went to the others")

    def _bring_forward(self, epoch: int, donors: list[PeerID]) -> bool:
        """Every piece older than `epoch` brought to it with the rounds in between, from a donor's round log (fetched
        as a node behind fetches them: within the time their bytes take at --link-mbit, x3)."""
        oldest = self.assembly.oldest()
        peers = max(2, self._swarm.optimizer.tracker.global_progress.num_peers)
        rounds, donor = self._catchup.fetch_rounds([d.to_base58() for d in donors], oldest, epoch - oldest, peers)
        if rounds is None:
            return False
        self.assembly.bring_forward(rounds, self._limit, self._lr, self._mu)
        logger.info(f"Brought the ranges of epochs {oldest}..{epoch - 1} to epoch {epoch} with the rounds from "
                    f"{donor}")
        return True

    def _check(self, began: float) -> Optional[bool]:
        """True once the pieces are loaded and agree with what the peers publish for their epoch; None when the
        swarm moved past that epoch's records meanwhile (the pieces go forward again); else False."""
        epoch = self.assembly.newest()
        deadline = time.monotonic() + (RECORD_WAIT_S if epoch > 0 else 0.0)  # epoch 0: the swarm's start
        while (found := reference_of(self._agreement.records(epoch))) is None and time.monotonic() < deadline:
            if self._stop.wait(0.2):
                return False
        if found is None and epoch > 0:
            swarm_epoch = self._swarm_epoch()
            if swarm_epoch - 1 > epoch:
                logger.info(f"The swarm moved on to epoch {swarm_epoch} while the ranges came to epoch {epoch}, "
                            f"whose records are gone: bringing them forward again")
                return None
            logger.info(f"No peer publishes its bytes for epoch {epoch}: nothing to check the ranges against")
            return False
        with self._outer.writing():  # a range donor reading them sees them move
            self.assembly.load_into(self._params, *self._outer.momentum(self._params))
        digest = params_digest(self._model)
        if not (digest == found[1].digest if found is not None else self._agreement.is_epoch_zero(digest)):
            logger.warning(f"The ranges assembled for epoch {epoch} are not the bytes the peers publish")
            return False
        roundlog.adopt_epoch(self._swarm.optimizer, epoch)
        took = time.monotonic() - began
        per_donor = ", ".join(f"{peer} {n}" for peer, n in self.sources.most_common())
        logger.info(f"Downloaded the state of epoch {epoch} in ranges from {len(self.sources)} donors in {took:.1f}s "
                    f"({ranges.BYTES_PER_ELEMENT * self._total / 1e6:.1f} MB; ranges per donor: {per_donor})")
        return True
