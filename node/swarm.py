"""Joining the hivemind swarm: the DHT and the collaborative optimizer around the model's AdamW."""
from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Callable, Optional, Sequence

import hivemind
import torch
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

from node.config import SwarmConfig, TrainConfig

logger = get_logger(__name__)

# the tracker looks for fresh swarm progress at least this often: it bounds how far apart peers begin an update
TRACKER_MAX_REFRESH_S = 1.0


def create_dht(config: SwarmConfig) -> hivemind.DHT:
    identity_path = config.identity_path
    if identity_path and not os.path.exists(identity_path):
        P2P.generate_identity(identity_path)  # a stable peer id across restarts
        logger.info(f"Generated a new libp2p identity in {identity_path}")
    dht = hivemind.DHT(
        initial_peers=list(config.initial_peers),
        host_maddrs=list(config.host_maddrs),
        announce_maddrs=list(config.announce_maddrs) or None,
        identity_path=identity_path,
        start=True,
    )
    return dht


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(addr) for addr in dht.get_visible_maddrs()]


def make_local_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=train.learning_rate,
        betas=(train.beta1, train.beta2),
        eps=train.eps,
        weight_decay=train.weight_decay,
    )
    # Give AdamW its (empty) state now. hivemind otherwise creates it with a zero-gradient optimizer step, which
    # applies weight decay to the seeded weights and starts Adam's bias correction one step late.
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
    return optimizer


class SwarmOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that applies this peer's exact gradient whenever the swarm's average is unavailable,
    and that lets peers which just updated be preferred as the source of state downloads.

    hivemind 1.1.12 resets its gradient accumulators when a gradient all-reduce begins. When that round then
    fails (a peer times out), its fallback "proceeding with local gradients" reloads the zeroed accumulators, so
    the update is weight decay alone and the samples are lost. With no other peer it applies the accumulators
    without dividing them by the number of step() calls. The node keeps its own exact epoch gradient and hands it
    in through `local_gradients`.
    """

    local_gradients: Optional[Callable[[], Sequence[torch.Tensor]]] = None
    update_priority: float = 0.0  # added to the epoch as this peer's state-sharing priority after an update
    peers_in_last_update: int = 0
    last_update_epoch: int = -1  # the epoch this peer's last update made (a catch-up from peers changes none)

    def _load_exact_local_gradients(self) -> bool:
        if self.local_gradients is None:
            return False
        params = [p for group in self.state_averager.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for param, grad in zip(params, self.local_gradients()):
                param.grad.copy_(grad.view_as(param))
        return True

    def _load_local_gradients_into_optimizer(self):
        if self._load_exact_local_gradients():
            logger.info("Gradient averaging failed: this update uses this peer's own gradient")
            self.grad_averager.notify_used_averaged_gradients()
        else:
            super()._load_local_gradients_into_optimizer()

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        began = super()._begin_averaging_gradients(grad_scaler)
        if not began:
            # hivemind goes on with whatever is in .grad (the raw accumulators): put the exact gradient there
            self._load_exact_local_gradients()
        return began

    def _update_global_epoch(self, grad_scaler) -> None:
        self.peers_in_last_update = self.tracker.global_progress.num_peers  # those averaging this update
        # hivemind lets a peer that is one epoch behind make the update late, after the others made it together
        late = self.tracker.global_epoch > self.local_epoch
        super()._update_global_epoch(grad_scaler)
        self.last_update_epoch = self.local_epoch
        if not self.client_mode:
            bonus = late_priority(self.update_priority) if late else self.update_priority
            self.state_averager.state_sharing_priority = self.local_epoch + bonus


def update_priority(peer_id: str) -> float:
    """A peer's state-sharing priority bonus after an update, in [0.5, 1): above every peer that only caught up
    (hivemind gives those their epoch), and distinct per peer so that one peer of each epoch is the reference."""
    return 0.5 + 0.49 * int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") / 2 ** 32


def late_priority(bonus: float) -> float:
    """The bonus after an update made late, in (0, 0.26): below every peer that made it on time, so a late peer
    follows them; above those that only caught up."""
    return 0.01 + (bonus - 0.5) / 2


def make_swarm_optimizer(
    dht: hivemind.DHT, local_optimizer: torch.optim.Optimizer, swarm: SwarmConfig, verbose: bool = False
) -> hivemind.Optimizer:
    """Every node applies the same averaged update: gradients are all-reduced, then parameters and Adam moments.

    delay_state_averaging=False keeps state averaging inside the update, so peers are byte-identical after it.
    """
    return SwarmOptimizer(
        dht=dht,
        run_id=swarm.run_id,
        target_batch_size=swarm.target_batch_size,
        optimizer=local_optimizer,
        matchmaking_time=swarm.matchmaking_time_s,
        averaging_timeout=swarm.averaging_timeout_s,
        load_state_timeout=swarm.load_state_timeout_s,
        delay_state_averaging=False,
        reuse_grad_buffers=True,  # the node writes the exact samples-weighted gradient into .grad itself
        average_state_every=1,
        average_opt_statistics=("exp_avg", "exp_avg_sq"),
        averager_opts=dict(request_timeout=swarm.request_timeout_s),
        tracker_opts=dict(min_refresh_period=0.2, max_refresh_period=TRACKER_MAX_REFRESH_S, default_refresh_period=0.5),
        verbose=verbose,
    )


def wait_for_swarm_progress(optimizer: hivemind.Optimizer, timeout_s: float) -> bool:
    """Bounded wait for the tracker's first look at the swarm's progress (so global_epoch is real)."""
    return optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout_s)


def shutdown(optimizer: Optional[hivemind.Optimizer], dht: Optional[hivemind.DHT],
             timeout_s: Optional[float] = None) -> None:
    """Idempotent: the training thread and a stopping main thread may both call it.

    hivemind's own shutdown waits on an all-reduce in flight and then on each process's grace period in turn
    (more than 15 s seen here). With `timeout_s` it gets that long; then hivemind's processes still alive are
    terminated, which is what hivemind itself does when a grace period runs out.
    """
    if timeout_s is None:
        _shut_down(optimizer, dht)
        return
    deadline = time.monotonic() + timeout_s
    threading.Thread(target=_shut_down, args=(optimizer, dht), name="dtrain-shutdown", daemon=True).start()
    averagers = (getattr(optimizer, "grad_averager", None), getattr(optimizer, "state_averager", None))
    processes = [p for p in (*averagers, dht) if p is not None]
    # wait for the processes, not the thread: another thread may be inside the graceful shutdown already
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    for process in processes:
        if process.is_alive():
            logger.warning(f"{type(process).__name__} did not shut down within {timeout_s:.0f}s; terminating it")
            process.terminate()


def _shut_down(optimizer: Optional[hivemind.Optimizer], dht: Optional[hivemind.DHT]) -> None:
    for part in (optimizer, dht):  # the DHT last: its shutdown also stops the p2pd child process
        if part is None or getattr(part, "_dtrain_shut_down", False):
            continue
        part._dtrain_shut_down = True
        try:
            part.shutdown()
        except Exception as e:
            logger.warning(f"Shutting down {type(part).__name__} failed: {e!r}")


# ---- who is in the swarm: every node announces itself, idle or not (hivemind's progress records list only
# peers that are accumulating samples) ------------------------------------------------------------------------

NODES_TTL_S = 20.0  # an announcement expires unless refreshed


def _nodes_key(run_id: str) -> str:
    return f"dtrain_{run_id}_nodes"


def _digests_key(run_id: str, epoch: int) -> str:
    return f"dtrain_{run_id}_digests_{epoch}"


def announce(dht: hivemind.DHT, run_id: str, peer_id: str, info: dict, timeout_s: float = 5.0) -> bool:
    return _store_record(dht, _nodes_key(run_id), peer_id, dict(info, time=get_dht_time()), timeout_s)


def _store_record(dht: hivemind.DHT, key: str, subkey: str, value: dict, timeout_s: float) -> bool:
    """Store one peer's record under a DHT dictionary entry for NODES_TTL_S; False (logged) when it fails."""
    future = dht.store(key, value, get_dht_time() + NODES_TTL_S, subkey=subkey, return_future=True)
    try:
        return bool(future.result(timeout_s))
    except Exception as e:
        logger.warning(f"Storing {key} in the DHT failed: {e!r}")
        return False


def list_nodes(dht: hivemind.DHT, run_id: str, timeout_s: float = 5.0) -> dict[str, dict]:
    """peer id -> the info it announced, for every node seen in the last NODES_TTL_S."""
    return _read_records(dht, _nodes_key(run_id), timeout_s)


def _read_records(dht: hivemind.DHT, key: str, timeout_s: float) -> dict[str, dict]:
    """subkey -> dict value of a DHT dictionary entry; {} when it is missing or the lookup fails (logged)."""
    future = dht.get(key, latest=True, return_future=True)
    try:
        found = future.result(timeout_s)
    except Exception as e:
        logger.warning(f"Reading {key} from the DHT failed: {e!r}")
        return {}
    if found is None or not isinstance(found.value, dict):
        return {}
    return {str(k): v.value for k, v in found.value.items() if isinstance(v.value, dict)}


# ---- what each peer's parameters are after each update: peers that updated together compare before they serve
# the new step, and a joiner checks which epoch the state it downloaded belongs to --------------------------------

def publish_digest(dht: hivemind.DHT, run_id: str, epoch: int, peer_id: str, digest: str, priority: float,
                   timeout_s: float = 5.0) -> bool:
    record = dict(digest=digest, priority=priority)
    return _store_record(dht, _digests_key(run_id, epoch), peer_id, record, timeout_s)


def list_digests(dht: hivemind.DHT, run_id: str, epoch: int, timeout_s: float = 5.0) -> dict[str, dict]:
    """peer id -> {digest, priority} for every peer that published its parameters after update `epoch`."""
    records = _read_records(dht, _digests_key(run_id, epoch), timeout_s)
    return {peer: r for peer, r in records.items() if {"digest", "priority"} <= r.keys()}
