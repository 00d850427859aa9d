"""The sparse round's exchange: every member's payload reaches every member, and each computes the same average.

hivemind's butterfly all-reduce moves dense parts and hands each member the average of a part as a delta from its
own values, so members end a round with averages that differ in the last bits, and the parameters then need an
averaging round of their own (4 bytes per parameter) to agree. With top-k payloads (node.lowcomm.sparse) an
all-to-all exchange is cheaper and exact: every member decodes the same bytes and sums them in the group's order, so
the averaged pseudo-gradient, and the outer step after it, are the same bits everywhere.

Who talks to whom (`plan`): each pair of full members swaps payloads over one stream, both directions at once, the
earlier member in the group's order dialing the later; so every member uploads N - 1 payloads and downloads as many,
where a hub relaying everything would upload (N - 1)^2. A client-mode member only dials out, as in hivemind: it
swaps payloads with every full member, and the group's first full member (its hub) also hands it the payloads of
the other client-mode members, whom nobody can dial. The commit step (node.swarm.commit) then makes the round all
or nothing: a member says complete only if it holds every member's payload, checked (node.lowcomm.sparse.decode)
before use.

Every member sends its epoch with its payload (the epoch of the anchor its pseudo-gradient is from) and its
length, and every payload is averaged. A group holds members at one epoch (node.swarm.groupsize.SameEpochGroup); a
round whose payloads name different epochs all the same is logged.

The node and its averager's process share two unlinked files (node.lowcomm.roundfiles, made before the fork): the node
writes there the payload it offers and its epoch (the payload is the one it built, so the averager does not encode
`.grad` again), and the averager writes there each round's record, every member's payload and weight
(node.lowcomm.record), which the node keeps in its round log once it applies that round's average.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import AsyncIterator, Dict, NamedTuple, Optional, Sequence

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.logging import get_logger

from dtrain.node import memory
from dtrain.node.lowcomm import record, sparse
from dtrain.node.lowcomm.roundfiles import HEADER, UNKNOWN_EPOCH, RoundFiles, framed, framed_size, unframed
from dtrain.node.swarm.commit import CommittingGradientAverager, commit_window, record_key

logger = get_logger(__name__)

CHUNK_BYTES = 1 << 20  # payload bytes per stream message
REGISTER_WAIT_S = 5.0  # how long a member waits for a round it has not begun yet when a peer's payload arrives
WATCH_EVERY_S = 1.0  # how often a member checks that its round can still complete (`_watch`)
GONE_AFTER_S = 5.0  # a member that is to call this one and has not by then is asked whether it is still there
ASK_TIMEOUT_S = REGISTER_WAIT_S + 5.0  # a live member answers that question within REGISTER_WAIT_S
class Plan(NamedTuple):
    """One member's part in a round's exchange."""

    dial: tuple[PeerID, ...]  # the members this one calls, in the group's order
    accept: frozenset[PeerID]  # the members that call this one
    hub: PeerID  # the first full member: it forwards client-mode members' payloads to each other
    clients: frozenset[PeerID]

    def answer(self, me: PeerID, caller: PeerID) -> tuple[PeerID, ...]:
        """Whose payloads `me` sends back to `caller`: its own, and at the hub, the other client-mode members'."""
        if me == self.hub and caller in self.clients:
            return (me, *sorted(self.clients - {caller}))
        return (me,)


def plan(members: Sequence[PeerID], full: Sequence[bool], me: PeerID) -> Optional[Plan]:
    """`me`'s part in the exchange of a group (members in the group's order, whether each accepts connections);
    None if no member accepts connections."""
    fulls = [peer for peer, ok in zip(members, full) if ok]
    if not fulls:
        return None
    clients = frozenset(peer for peer, ok in zip(members, full) if not ok)
    if me in clients:
        return Plan(tuple(fulls), frozenset(), fulls[0], clients)
    mine = fulls.index(me)
    return Plan(tuple(fulls[mine + 1:]), frozenset(fulls[:mine]) | clients, fulls[0], clients)


@dataclass
class _Round:
    """One member's view of a round: its own payload, the plan and the payloads received so far."""

    members: tuple[PeerID, ...]
    plan: Plan
    weight: float
    own: bytes
    payloads: Dict[PeerID, tuple[float, bytes]] = field(default_factory=dict)
    callers: set[PeerID] = field(default_factory=set)  # the members whose call reached this one
    broken: Optional[str] = None  # why the round cannot complete any more, once that is known
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def put(self, peer: PeerID, weight: float, data: bytes) -> None:
        async with self.arrived:
            self.payloads.setdefault(peer, (weight, data))
            self.arrived.notify_all()

    async def fail(self, reason: str) -> None:
        """The round cannot complete (the first reason stays): every wait for payloads ends."""
        async with self.arrived:
            self.broken = self.broken or reason
            self.arrived.notify_all()

    async def wait_for(self, peers: Sequence[PeerID], timeout: float) -> bool:
        """Whether the payloads of `peers` are all in, waiting up to `timeout` (False at once if the round broke)."""
        async with self.arrived:
            try:
                await asyncio.wait_for(self.arrived.wait_for(
                    lambda: self.broken is not None or all(p in self.payloads for p in peers)), timeout)
            except asyncio.TimeoutError:
                return False
            return self.broken is None

    def missing(self) -> list[str]:
        return [str(p) for p in self.members if p not in self.payloads]


def _chunks(group_id: bytes, peer: PeerID, weight: float, data: bytes) -> list[averaging_pb2.AveragingData]:
    parts = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    return [averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, group_id=group_id, peer_id=peer.to_bytes(),
                                        weight=weight, tensor_part=runtime_pb2.Tensor(buffer=part)) for part in parts]


class _TooLarge(Exception):
    pass


@dataclass
class _Arriving:
    """A framed payload arriving in chunks: whole once it holds the length its header declares."""

    weight: float
    limit: int  # the most bytes a framed payload may have
    chunks: list = field(default_factory=list)
    size: int = 0
    whole_size: Optional[int] = None

    def add(self, chunk: bytes) -> None:
        """One more chunk; _TooLarge past the limit or past the declared length."""
        self.chunks.append(chunk)
        self.size += len(chunk)
        if self.whole_size is None and self.size >= HEADER.size:
            self.whole_size = framed_size(b"".join(self.chunks)[:HEADER.size])
        if self.size > self.limit or (self.whole_size is not None and self.size > min(self.whole_size, self.limit)):
            raise _TooLarge()

    @property
    def whole(self) -> bool:
        return self.whole_size is not None and self.size == self.whole_size

    def data(self) -> bytes:
        return b"".join(self.chunks)


class SparseGatherAverager(CommittingGradientAverager):
    """A CommittingGradientAverager whose round is an all-to-all exchange of sparse payloads.

    `fraction` is the top-k fraction the node's payloads keep (it bounds what a member may send)."""

    def __init__(self, *args, fraction: float, **kwargs):
        self.fraction = fraction
        self.round_files = RoundFiles()  # before hivemind forks the averager's process: both hold them
        self._rounds: Dict[bytes, _Round] = {}
        self._round_begun: Optional[asyncio.Condition] = None
        super().__init__(*args, **kwargs)

    @cached_property  # read in the averager's process, once: the tensors' sizes never change
    def _limits(self) -> tuple[int, int]:
        sizes = [t.numel() for t in self._averaged_tensors]
        return sum(sizes), sparse.max_kept(sizes, self.fraction)

    @cached_property
    def _max_payload_bytes(self) -> int:  # framed: with its epoch and length
        total, limit = self._limits
        return HEADER.size + sparse.payload_bytes(limit, total, quantized=True)

    async def _exchange(self, group_info: GroupInfo, min_vector_size: int, weight: float = 1.0, **kwargs):
        # the round holds the averaged tensors (the node's .grad, node.swarm.commit) from its offer to its average,
        # as hivemind's all-reduce does: a node that stopped waiting for the round waits on that lock
        async with enter_asynchronously(self.get_tensors()) as tensors:
            try:
                return await self._exchange_holding(tensors, group_info, weight)
            finally:
                self._hand_back()

    def _hand_back(self) -> None:
        """What the round decoded (every member's positions and values, a bounded piece at a time) is free once it is
        averaged, and glibc keeps it in this process's heap until a later allocation reuses it (a round of two
        1M-element payloads leaves 31-35 MB so: tests/test_gather.py). Handed back to the system after every
        round."""
        memory.trim()

    async def _exchange_holding(self, tensors, group_info: GroupInfo, weight: float):
        began = get_dht_time()
        publish_by, _ = commit_window(self._allreduce_timeout)
        _, mode_ids, user_gathered_bytes = zip(*map(self.serializer.loads, group_info.gathered))
        gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_gathered_bytes)))
        full = [AveragingMode(mode) != AveragingMode.CLIENT for mode in mode_ids]
        my_plan = plan(group_info.peer_ids, full, self.peer_id)
        if my_plan is None:
            return gathered, "no member of the group accepts connections to exchange the payloads"
        group_id = group_info.group_id
        # no butterfly runner in this round: its slot is done, as hivemind expects of a round (rpc_aggregate_part)
        runner_slot = self._running_groups.get(group_id)
        if runner_slot is not None and not runner_slot.done():
            runner_slot.set_result(None)
        total, limit = self._limits
        epoch, own = self.round_files.offered()
        own = framed(epoch, own or sparse.encode(tensors, quantized=True))
        weight = float(weight)

        round_ = _Round(group_info.peer_ids, my_plan, weight, own)
        await round_.put(self.peer_id, weight, own)
        self._rounds[group_id] = round_
        await self._announce_round()
        calls = [asyncio.create_task(self._call(peer, group_id, round_)) for peer in my_plan.dial]
        everyone = asyncio.create_task(round_.wait_for(group_info.peer_ids, timeout=float("inf")))
        watch = asyncio.create_task(self._watch(round_, group_info, began))
        pending = {everyone, watch, *calls}
        try:
            while not everyone.done():
                timeout = began + publish_by - get_dht_time()
                if timeout <= 0:
                    return gathered, f"no payload from {', '.join(round_.missing())} in time"
                done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task in calls and task.result() is not None:
                        return gathered, task.result()
            if round_.broken is not None:
                return gathered, round_.broken
        finally:
            for task in pending:
                task.cancel()
            asyncio.get_event_loop().call_later(2 * REGISTER_WAIT_S, self._rounds.pop, group_id, None)

        try:
            epochs, payloads = zip(*(unframed(round_.payloads[peer][1]) for peer in group_info.peer_ids))
        except ValueError as e:
            return gathered, f"a payload was refused: {e}"
        weights = [round_.payloads[peer][0] for peer in group_info.peer_ids]
        if not sum(weights) > 0:  # full peers that joined for client-mode peers who then were not in the group
            return gathered, "the group brought no samples (every weight 0)"
        known = {e for e in epochs if e != UNKNOWN_EPOCH}
        if len(known) > 1:
            logger.warning(f"A gradient round of members at epochs {sorted(known)} (this peer at {epoch}): a member "
                           f"behind makes an update the others do not")
        try:
            decoded = (sparse.decode(payload, total, limit, quantized=True) for payload in payloads)
            # straight into the round's tensors (the node's .grad): no flat copy of the model in this process. A
            # payload refused part-way leaves them half-written, in a round that is then aborted: nobody applies
            # them (the node writes its own gradient over them, node.swarm.optimizer)
            sparse.average_into(decoded, weights, tensors)
        except ValueError as e:
            return gathered, f"a payload was refused: {e}"
        try:  # the node logs it if it applies this round (node.lowcomm.roundlog.CatchUp)
            self.round_files.write_record(list(zip(weights, payloads)))
        except (OSError, record.BadRecord) as e:  # the round goes on; the node finds no record of it to log
            logger.warning(f"Could not write the round's record: {e!r}")
        return gathered, None

    async def _watch(self, round_: _Round, group_info: GroupInfo, began: float) -> None:
        """Ends the round early (`_Round.fail`) once it cannot complete, every WATCH_EVERY_S until it is over:
        - a member already said in the commit step that its exchange failed (node.swarm.commit);
        - a member that is to call this one (`Plan.accept`) has not called GONE_AFTER_S into the round, and its
          averager does not answer a call (`_still_there`): its process is gone. Not its connection: the averager is a
          process of its own, which can be gone while its node's DHT and libp2p daemon keep the connections open.
        A member that called and stopped part-way ends the round from its stream (`_receive`). Without this, a
        member killed inside a round cost the others the whole deadline (38 s for the default model at 10 Mbit/s).
        A live member that is busy answers late or not at all, and is waited for until the deadline, as is a
        client-mode member, whom nobody can call."""
        key = record_key(self.prefix, group_info.group_id)
        members = {peer.to_base58() for peer in group_info.peer_ids}
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            try:
                said = await self._said(key)
                failed = sorted(peer for peer in members if said.get(peer) is False)
                if failed:
                    await round_.fail(f"the exchange of {', '.join(failed)} failed")
                    return
                if get_dht_time() - began < GONE_AFTER_S:
                    continue
                awaited = [peer for peer in round_.plan.accept if peer not in round_.plan.clients
                           and peer not in round_.payloads and peer not in round_.callers]
                there = await asyncio.gather(*(self._still_there(peer, group_info.group_id) for peer in awaited))
            except Exception as e:  # a DHT that did not answer: the round's deadline still holds
                logger.debug(f"Watching round {group_info.group_id.hex()[:8]} failed: {e!r}")
                continue
            gone = [str(peer) for peer, answered in zip(awaited, there) if answered is False]
            if gone:
                await round_.fail(f"{', '.join(gone)} left the round (its averager fails a call "
                                  f"{GONE_AFTER_S:g}s into it)")
                return

    async def _still_there(self, peer: PeerID, group_id: bytes) -> Optional[bool]:
        """Whether the averager of a full member answers a call of this round (True), fails it (False: it is gone,
        whatever its daemon does), or neither within ASK_TIMEOUT_S (None). The call carries no payload: a member
        refuses it (this one is not among the members that call it: `Plan.accept`), at once, or once its round
        begins, or after REGISTER_WAIT_S."""
        async def question():
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, group_id=group_id,
                                              peer_id=self.peer_id.to_bytes())

        async def first_answer() -> bool:
            stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
            async for _ in await stub.rpc_sparse_gather(question()):
                return True
            return False  # the stream ended with no answer at all

        try:
            return await asyncio.wait_for(first_answer(), ASK_TIMEOUT_S)
        except asyncio.TimeoutError:
            return None
        except Exception as e:
            logger.debug(f"{peer} failed a call of round {group_id.hex()[:8]}: {e!r}")
            return False

    async def _call(self, peer: PeerID, group_id: bytes, round_: _Round) -> Optional[str]:
        """Swap payloads with `peer`: this member's out, the ones `peer` answers with in; why not, if it failed.

        This member's side of the stream stays open until it holds the whole answer, and `peer` ends its side only
        after this one (`rpc_sparse_gather`): a side that ends while its last bytes are still on their way over a
        slow link can have them cut off (p2pd resets a stream that is closed with bytes unread), which the receiver
        would see as a clean end of a shorter payload."""
        expected = set(round_.plan.answer(peer, self.peer_id))
        answered = asyncio.Event()

        async def requests():
            for message in _chunks(group_id, self.peer_id, round_.weight, round_.own):
                yield message
            # bounded: hivemind awaits this side's end after the answer's, also when the answer was cut short
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(answered.wait(), self._allreduce_timeout)

        parts: Dict[PeerID, _Arriving] = {}
        try:
            stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
            stream = await stub.rpc_sparse_gather(requests())
            async for message in stream:
                if message.code != averaging_pb2.AVERAGED_PART:
                    return f"{peer} refused the payload ({averaging_pb2.MessageCode.Name(message.code)})"
                sender = PeerID(message.peer_id)
                if sender not in expected:
                    return f"{peer} sent a payload of {sender}, not one it answers with"
                part = parts.setdefault(sender, _Arriving(message.weight, self._max_payload_bytes))
                try:
                    part.add(message.tensor_part.buffer)
                except _TooLarge:
                    return f"{peer} sent more than a payload for {sender}"
                if all(p in parts and parts[p].whole for p in expected):
                    answered.set()
        except Exception as e:  # a dropped stream, an unreachable peer: the round cannot complete
            return f"the exchange with {peer} failed ({type(e).__name__}: {e})"
        finally:
            answered.set()
        missing = [f"{p} ({parts[p].size if p in parts else 0} bytes)" for p in expected
                   if p not in parts or not parts[p].whole]
        if missing:
            return f"{peer} sent no whole payload of {', '.join(missing)}"
        for sender, part in parts.items():
            await round_.put(sender, part.weight, part.data())
        return None

    async def _announce_round(self) -> None:
        if self._round_begun is None:
            self._round_begun = asyncio.Condition()
        async with self._round_begun:
            self._round_begun.notify_all()

    async def _wait_round(self, group_id: bytes) -> Optional[_Round]:
        """This member's round `group_id`, waiting (bounded) for a round it has not begun yet."""
        if self._round_begun is None:
            self._round_begun = asyncio.Condition()
        async with self._round_begun:
            try:
                await asyncio.wait_for(self._round_begun.wait_for(lambda: group_id in self._rounds), REGISTER_WAIT_S)
            except asyncio.TimeoutError:
                return None
        return self._rounds.get(group_id)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Dense parts have no place in a sparse round: refused."""
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)

    async def rpc_sparse_gather(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A member's payload in; this member's own payload out while it arrives (and at the hub, to a client-mode
        member, the other client-mode members' payloads once they are in)."""
        first = await anext(stream)
        round_ = await self._wait_round(first.group_id)
        caller = context.remote_id
        if round_ is None or caller not in round_.plan.accept or caller in round_.payloads:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        round_.callers.add(caller)
        receiving = asyncio.create_task(self._receive(first, stream, caller, round_))
        try:
            for message in _chunks(first.group_id, self.peer_id, round_.weight, round_.own):
                yield message
            forward = round_.plan.answer(self.peer_id, caller)[1:]
            if forward and not await round_.wait_for(forward, timeout=self._allreduce_timeout):
                yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
                return
            for peer in forward:
                weight, data = round_.payloads[peer]
                for message in _chunks(first.group_id, peer, weight, data):
                    yield message
            # the caller ends its side once it holds the whole answer (`_call`): only then does this side end
            await asyncio.wait_for(receiving, self._allreduce_timeout)
        except _TooLarge:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        except asyncio.TimeoutError:
            pass  # the round has run out of time: the caller's exchange fails, or has failed, by its own deadline
        finally:
            receiving.cancel()

    async def _receive(self, first: averaging_pb2.AveragingData, stream: AsyncIterator[averaging_pb2.AveragingData],
                       caller: PeerID, round_: _Round) -> None:
        """Read `caller`'s payload (bounded) into the round as soon as it is whole, then wait for the caller to end
        its side of the stream. A stream that ends or breaks before the payload is whole ends the round: the caller
        has gone, or sent less than it declared."""
        part = _Arriving(float(first.weight), self._max_payload_bytes)
        part.add(first.tensor_part.buffer)
        if part.whole:
            await round_.put(caller, part.weight, part.data())
        try:
            async for message in stream:
                was_whole = part.whole
                part.add(message.tensor_part.buffer)  # past the whole payload: _TooLarge
                if part.whole and not was_whole:
                    await round_.put(caller, part.weight, part.data())
        except (_TooLarge, asyncio.CancelledError):
            raise
        except Exception as e:
            if not part.whole:
                await round_.fail(f"the stream from {caller} broke after {part.size} bytes of its payload "
                                  f"({type(e).__name__})")
            return
        if not part.whole:
            await round_.fail(f"{caller} ended its stream after {part.size} bytes of its payload")
