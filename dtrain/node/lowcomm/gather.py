"""The sparse round's exchange: every member's payload reaches every member, and each computes the same average.

hivemind's butterfly all-reduce moves dense parts and hands each member the average of a part as a delta from its
own values, so members end a round with averages that differ in the last bits, and the parameters then need an
averaging round of their own (4 bytes per parameter) to agree. With top-k payloads (node.lowcomm.sparse) a gather is
cheaper and exact: the group's first full (non-client) member is its hub; every other member streams its payload to
the hub and gets back the payloads of all the others; every member decodes the same bytes and sums them in the
group's order, so the averaged pseudo-gradient, and the outer step after it, are the same bits everywhere.

A client-mode member only dials out, as in hivemind. The hub sends (members - 1) payloads to each member: fine for
payloads of about 1% of the model. The commit step (node.swarm.commit) then makes the round all or nothing: a member
says complete only if it holds every member's payload, checked (node.lowcomm.sparse.decode) before use.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import cached_property
from typing import AsyncIterator, Dict, Optional

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, enter_asynchronously
from hivemind.utils.logging import get_logger

from dtrain.node.lowcomm import sparse
from dtrain.node.swarm.commit import CommittingGradientAverager, commit_window

logger = get_logger(__name__)

CHUNK_BYTES = 1 << 20  # payload bytes per stream message
REGISTER_WAIT_S = 5.0  # how long the hub waits for a round it has not begun yet when a member's payload arrives


@dataclass
class _Gather:
    """The hub's view of one round: the payloads received so far, by member."""

    members: tuple[PeerID, ...]
    payloads: Dict[PeerID, tuple[float, bytes]] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, peer: PeerID, weight: float, data: bytes) -> None:
        self.payloads[peer] = (weight, data)
        if len(self.payloads) == len(self.members):
            self.complete.set()


def _chunks(group_id: bytes, peer: PeerID, weight: float, data: bytes) -> list[averaging_pb2.AveragingData]:
    parts = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    return [averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, group_id=group_id, peer_id=peer.to_bytes(),
                                        weight=weight, tensor_part=runtime_pb2.Tensor(buffer=part)) for part in parts]


class SparseGatherAverager(CommittingGradientAverager):
    """A CommittingGradientAverager whose round is a gather of sparse payloads through the group's hub.

    `fraction` is the top-k fraction the node's payloads keep (it bounds what a member may send)."""

    def __init__(self, *args, fraction: float, **kwargs):
        self.fraction = fraction
        self._gathers: Dict[bytes, _Gather] = {}
        self._gather_begun: Optional[asyncio.Condition] = None
        super().__init__(*args, **kwargs)

    @cached_property  # read in the averager's process, once: the tensors' sizes never change
    def _limits(self) -> tuple[int, int]:
        sizes = [t.numel() for t in self._averaged_tensors]
        return sum(sizes), sparse.max_kept(sizes, self.fraction)

    @cached_property
    def _max_payload_bytes(self) -> int:
        return sparse.HEADER.size + sparse.BYTES_PER_KEPT * self._limits[1]

    async def _exchange(self, group_info: GroupInfo, min_vector_size: int, weight: float = 1.0, **kwargs):
        began = get_dht_time()
        publish_by, _ = commit_window(self._allreduce_timeout)
        _, mode_ids, user_gathered_bytes = zip(*map(self.serializer.loads, group_info.gathered))
        gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_gathered_bytes)))
        full = [peer for peer, mode in zip(group_info.peer_ids, mode_ids) if AveragingMode(mode) != AveragingMode.CLIENT]
        if not full:
            return gathered, "no member of the group accepts connections to gather the payloads"
        hub, group_id = full[0], group_info.group_id
        # no butterfly runner in this round: its slot is done, as hivemind expects of a round (rpc_aggregate_part)
        runner_slot = self._running_groups.get(group_id)
        if runner_slot is not None and not runner_slot.done():
            runner_slot.set_result(None)
        total, limit = self._limits
        async with enter_asynchronously(self.get_tensors()) as tensors:
            own = sparse.encode(_flat(tensors))
        weight = float(weight)

        if hub == self.peer_id:
            gather = self._gathers.setdefault(group_id, _Gather(group_info.peer_ids))
            await self._announce_gather()
            gather.put(self.peer_id, weight, own)
            try:
                await asyncio.wait_for(gather.complete.wait(), timeout=max(0.0, began + publish_by - get_dht_time()))
            except asyncio.TimeoutError:
                missing = [str(p) for p in group_info.peer_ids if p not in gather.payloads]
                return gathered, f"no payload from {', '.join(missing)} in time"
            finally:
                asyncio.get_event_loop().call_later(2 * REGISTER_WAIT_S, self._gathers.pop, group_id, None)
            received = dict(gather.payloads)
        else:
            received = {self.peer_id: (weight, own)}
            try:
                reason = await asyncio.wait_for(self._from_hub(hub, group_info, weight, own, received),
                                                timeout=max(0.0, began + publish_by - get_dht_time()))
            except asyncio.TimeoutError:
                reason = f"the hub {hub} sent the payloads too late"
            if reason is not None:
                return gathered, reason

        try:
            decoded = [sparse.decode(received[peer][1], total, limit) for peer in group_info.peer_ids]
            average = sparse.average(decoded, [received[peer][0] for peer in group_info.peer_ids], total)
        except ValueError as e:
            return gathered, f"a payload was refused: {e}"
        async with enter_asynchronously(self.get_tensors()) as tensors:
            offset = 0
            for t in tensors:
                t.copy_(average[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return gathered, None

    async def _from_hub(self, hub: PeerID, group_info: GroupInfo, weight: float, own: bytes,
                        received: Dict[PeerID, tuple[float, bytes]]) -> Optional[str]:
        """Send this member's payload to the hub and put the others' into `received`; why not, if it failed."""
        stub = type(self).get_stub(self._p2p, hub, namespace=self.prefix)
        stream = await stub.rpc_sparse_gather(as_aiter(*_chunks(group_info.group_id, self.peer_id, weight, own)))
        parts: Dict[PeerID, list] = {}
        async for message in stream:
            if message.code != averaging_pb2.AVERAGED_PART:
                return f"the hub {hub} refused the payload ({averaging_pb2.MessageCode.Name(message.code)})"
            peer = PeerID(message.peer_id)
            if peer not in group_info.peer_ids or peer == self.peer_id:
                return f"the hub {hub} sent a payload of {peer}, not of another member"
            part = parts.setdefault(peer, [message.weight, [], 0])  # weight, chunks, bytes so far
            part[1].append(message.tensor_part.buffer)
            part[2] += len(message.tensor_part.buffer)
            if part[2] > self._max_payload_bytes:
                return f"the hub {hub} sent more than a payload for {peer}"
        for peer, (w, chunks, _) in parts.items():
            received[peer] = (w, b"".join(chunks))
        missing = [str(p) for p in group_info.peer_ids if p not in received]
        return f"the hub {hub} sent no payload of {', '.join(missing)}" if missing else None

    async def _announce_gather(self) -> None:
        if self._gather_begun is None:
            self._gather_begun = asyncio.Condition()
        async with self._gather_begun:
            self._gather_begun.notify_all()

    async def _wait_gather(self, group_id: bytes) -> Optional[_Gather]:
        """The hub's gather for `group_id`, waiting (bounded) for a round this hub has not begun yet."""
        if self._gather_begun is None:
            self._gather_begun = asyncio.Condition()
        deadline = asyncio.get_event_loop().time() + REGISTER_WAIT_S
        async with self._gather_begun:
            while group_id not in self._gathers:
                left = deadline - asyncio.get_event_loop().time()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(self._gather_begun.wait(), timeout=left)
                except asyncio.TimeoutError:
                    return None
        return self._gathers.get(group_id)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Dense parts have no place in a sparse round: refused."""
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)

    async def rpc_sparse_gather(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A member's payload in; the other members' payloads out, once the hub holds them all."""
        first = await anext(stream)
        gather = await self._wait_gather(first.group_id)
        sender = context.remote_id
        if gather is None or sender not in gather.members or sender in gather.payloads:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        chunks, size = [first.tensor_part.buffer], len(first.tensor_part.buffer)
        async for message in stream:
            chunks.append(message.tensor_part.buffer)
            size += len(message.tensor_part.buffer)
            if size > self._max_payload_bytes:
                yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
        gather.put(sender, float(first.weight), b"".join(chunks))
        try:
            await asyncio.wait_for(gather.complete.wait(), timeout=self._allreduce_timeout)
        except asyncio.TimeoutError:
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
            return
        for peer in gather.members:
            if peer != sender:
                weight, data = gather.payloads[peer]
                for message in _chunks(first.group_id, peer, weight, data):
                    yield message


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])

