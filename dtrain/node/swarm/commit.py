"""All-or-nothing gradient rounds: a round's average is applied only if every member's all-reduce was complete.

hivemind's all-reduce degrades instead of failing. A reducer that stops answering leaves its parts of the average at
each peer's own values (`register_failed_reducer`), and a sender that stops is left out of the parts it had not sent
yet (`on_sender_failed`); every peer still gets a result. So when a member fails in the middle of a round, the
others' averages hold some parts of its gradient and not others, and its own round failed, so it carries its whole
gradient: those parts would be applied twice. And two survivors that kept their own values for a failed reducer's
parts apply different updates.

The commit step after the all-reduce makes a round all or nothing. Every member publishes in the DHT whether its
all-reduce was complete (every part averaged over every member), then waits for the others' records. A member
applies the average only when every member of the group said complete; otherwise the round is aborted on every
member: each one makes its update with its own gradient, exactly as after a failed round, and the node's agreement
then serves one of those updates and carries the others' gradients (docs/architecture.md, "A step is served only once it is the
swarm's").

Members decide on the same records, and the deadlines make them see the same records: a member says complete only
within `publish_by` seconds of its all-reduce's start, and waits for the others until `decide_by`. A record said in
time reaches every member before its deadline unless the DHT takes longer than `decide_by - publish_by` (at least
one second) to show a stored value, or the members began the all-reduce that far apart.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
from dataclasses import dataclass
from typing import Optional

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.group_info import GroupInfo
from hivemind.optim.grad_averager import GradientAverager
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.logging import get_logger

from dtrain.node.swarm.deadlines import Retimable
from dtrain.node.swarm.groupsize import ExpectedGroup, SameEpochGroup
from dtrain.node.swarm.keygate import KeyGatedServicer
from dtrain.node.swarm.records import by_peer

logger = get_logger(__name__)

MAX_COMMIT_WAIT_S = 5.0  # the window between the last moment to say "complete" and the decision
DECIDE_MARGIN_S = 0.5  # the decision comes this long before hivemind's own bound on the round
POLL_S = 0.02  # how often a member reads the others' records while it waits
RECORD_TTL_S = 60.0  # how long the records stay in the DHT


@dataclass(frozen=True)
class AbortedRound:
    """What a gradient round returns instead of its gathered data when its average must not be applied."""

    reason: str
    ran_out: bool = False  # the round ran out of time (its exchange, or a member's record, came too late)
    behind: bool = False  # it ended in matchmaking because the swarm is past its epoch (node.swarm.groupsize)


class ExchangeClock:
    """How long the exchange of the last committed round took (from the group's start to this member's complete
    average: no matchmaking before it, no commit step after it). The averager's process writes it, the node's reads
    it after the round: a round's result carries only what hivemind gathers."""

    def __init__(self):
        self._shared = mp.Array("d", 2)  # (rounds committed, seconds of the last one's exchange)

    def record(self, seconds: float) -> None:
        with self._shared.get_lock():
            self._shared[0] += 1
            self._shared[1] = seconds

    def read(self) -> tuple[int, float]:
        """(rounds committed so far, the last one's exchange seconds)."""
        with self._shared.get_lock():
            return int(self._shared[0]), float(self._shared[1])


def commit_window(allreduce_timeout: float) -> tuple[float, float]:
    """(publish_by, decide_by): seconds after a member's all-reduce began."""
    decide_by = allreduce_timeout - DECIDE_MARGIN_S
    wait = max(1.0, min(MAX_COMMIT_WAIT_S, allreduce_timeout / 4))
    return decide_by - wait, decide_by


def chunk_timeout(allreduce_timeout: float) -> float:
    """How long a member waits for another member's next chunk before hivemind gives up on that member's parts.

    hivemind's default is the matchmaking time (seconds): a member whose process is slow for that long, on a busy
    host or behind a saturated uplink, has its parts dropped, and the commit step then aborts a round that would
    have completed. A member that died closes its streams, which fails its parts at once, so the only member this
    wait catches is a slow live one; and a round is judged by the commit step, which counts an all-reduce that ends
    by `publish_by`. So a chunk may take until then.
    """
    publish_by, _ = commit_window(allreduce_timeout)
    return publish_by


def incompleteness(runner: AllReduceRunner) -> Optional[str]:
    """Why this member's result is not the average over every member, or None when it is."""
    container, reducer = runner.tensor_part_container, runner.tensor_part_reducer
    if container.failed_size:
        return f"{container.failed_size} of {container.total_size} values came back from no reducer"
    left_out = [i for i, after in enumerate(reducer.sender_failed_after) if after < reducer.num_parts]
    if left_out:
        return f"senders {left_out} were left out of some parts this peer reduced"
    return None


def non_finite(tensors) -> Optional[str]:
    """Why a round's average must not be applied although every part of it came back, or None. A group whose
    members all brought no samples (full peers that joined for client-mode peers who then were not in it) has a
    total weight of 0, and hivemind's reducers divide by it: every value is NaN on every member. A member that sent
    non-finite values makes the parts it is in non-finite on every member too. The sum in float64 reads each tensor
    once, allocates nothing of the model's size, and cannot overflow on finite fp32 values."""
    if all(torch.isfinite(t.sum(dtype=torch.float64)) for t in tensors):
        return None
    return "its average is not finite (the group brought no samples, or a member sent non-finite values)"


def record_key(prefix: str, group_id: bytes) -> str:
    return f"{prefix}_commit_{group_id.hex()}"


class CommittingGradientAverager(Retimable, SameEpochGroup, ExpectedGroup, KeyGatedServicer, GradientAverager):
    """hivemind's GradientAverager with the commit step: its round returns the gathered data when every member's
    all-reduce was complete, else an `AbortedRound` (never an exception, so hivemind does not retry a round with
    tensors a failed attempt has half averaged).

    `record_subkey` is this peer's signed subkey (`RecordOwner.subkey`, node.swarm.records): the DHT signs its
    outcome with the peer's identity, so no member can say complete (or incomplete) for another. With `swarm_key`
    (a closed swarm) its RPCs answer only peers that prove the key (node.swarm.keygate). `exchanges` times each
    committed round's exchange; its deadline can change between rounds (node.swarm.deadlines.Retimable), and so can
    the number of members its group closes at (node.swarm.groupsize.ExpectedGroup), and its groups hold peers at one
    epoch (SameEpochGroup).
    """

    def __init__(self, *args, record_subkey: bytes, **kwargs):
        self.record_subkey = record_subkey
        self.exchanges = ExchangeClock()  # before the process starts: it shares the memory
        # The round averages the .grad buffers themselves (P less than a buffer of its own): they are hivemind's
        # accumulators already (reuse_grad_buffers) and in shared memory (node.swarm.state.keep_state_shared).
        # The node writes every .grad in full before each step (its exact gradient, or the low-comm offer), and
        # loads its own gradient into them whenever a round is not applied, so a round that fails halfway leaves
        # nothing behind; `reset_accumulated_grads_` leaves them alone (zeroing them would zero the round's input).
        params = tuple(kwargs.get("parameters", args[0] if args else ()))
        grads = tuple(p.grad for p in params)
        self.grads_averaged_in_place = bool(
            kwargs.get("reuse_grad_buffers") and not kwargs.get("averaged_grads") and grads
            and all(g is not None and g.is_shared() for g in grads))
        if self.grads_averaged_in_place:
            kwargs["averaged_grads"] = grads
        super().__init__(*args, **kwargs)

    @torch.no_grad()
    def reset_accumulated_grads_(self):
        if not self.grads_averaged_in_place:
            return super().reset_accumulated_grads_()
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size = None

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        """Nothing to download. hivemind.Optimizer has a joiner download the gradient averager's buffers after the
        parameters and optimizer state (a third more bytes for a per-step joiner, half more in low-comm mode), yet
        the next round overwrites them and the node reloads .grad from its own gradient first."""
        return None

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        began = get_dht_time()
        publish_by, decide_by = commit_window(self._allreduce_timeout)
        group_id = group_info.group_id
        try:
            gathered, reason = await self._exchange(group_info, min_vector_size, **kwargs)
        except Exception as e:  # hivemind wraps every failure of the round in a MatchmakingException
            gathered, reason = None, f"the all-reduce failed ({e})"
        exchange_s = get_dht_time() - began
        ran_out = exchange_s >= publish_by  # the exchange used its whole window, whatever else went wrong
        if reason is None and ran_out:
            reason = f"the all-reduce ended after the commit window ({publish_by:.1f}s)"
        key = record_key(self.prefix, group_id)
        await self._say(key, complete=reason is None)
        if reason is None:
            reason, ran_out = await self._others_incomplete(key, group_info, deadline=began + decide_by)
        if reason is not None:
            logger.info(f"Gradient round {group_id.hex()[:8]} aborted: {reason}")
            return AbortedRound(reason, ran_out)
        self.exchanges.record(exchange_s)
        return gathered

    async def _exchange(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        """The round's data exchange: (gathered data, None when this member's average is complete else why not).
        hivemind's butterfly all-reduce here; the sparse codec gathers payloads instead (node.lowcomm.gather)."""
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        # the round's runner stays registered until the round returns (DecentralizedAverager._step)
        reason = incompleteness(self._running_groups[group_info.group_id].result())
        if reason is None:  # every member sees the same averaged parts, so every member finds the same
            async with enter_asynchronously(self.get_tensors()) as tensors:
                reason = non_finite(tensors)
        return gathered, reason

    async def _say(self, key: str, complete: bool) -> None:
        try:
            await self.dht.store(key, subkey=self.record_subkey, value=complete,
                                 expiration_time=get_dht_time() + RECORD_TTL_S, return_future=True)
        except Exception as e:  # the others then decide without this record: they abort
            logger.warning(f"Could not publish the outcome of a gradient round: {e!r}")

    async def _said(self, key: str) -> dict[str, bool]:
        """peer id -> whether its exchange was complete, for the members that said so far under `key`."""
        found = await self.dht.get(key, latest=True, return_future=True)
        if not found or not isinstance(found.value, dict):
            return {}
        return by_peer({subkey: item.value for subkey, item in found.value.items()})

    async def _others_incomplete(self, key: str, group_info: GroupInfo, deadline: float) -> tuple[Optional[str], bool]:
        """(None, False) once every member said complete; else the reason to abort, and whether it is that a member
        said nothing in time."""
        members = {peer.to_base58() for peer in group_info.peer_ids}
        while True:
            said = await self._said(key)
            failed = sorted(peer for peer in members if said.get(peer) is False)
            if failed:
                return f"the all-reduce of {', '.join(failed)} was incomplete", False
            missing = members - said.keys()
            if not missing:
                return None, False
            if get_dht_time() >= deadline:
                return f"no outcome from {', '.join(sorted(missing))} in time", True
            await asyncio.sleep(POLL_S)
