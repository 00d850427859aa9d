"""Joining the hivemind swarm: the DHT and the collaborative optimizer around the model's AdamW."""
from __future__ import annotations

import os
from typing import Optional

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


def make_swarm_optimizer(
    dht: hivemind.DHT, local_optimizer: torch.optim.Optimizer, swarm: SwarmConfig, verbose: bool = False
) -> hivemind.Optimizer:
    """Every node applies the same averaged update: gradients are all-reduced, then parameters and Adam moments.

    delay_state_averaging=False keeps state averaging inside the update, so peers are byte-identical after it.
    """
    return hivemind.Optimizer(
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


def shutdown(optimizer: Optional[hivemind.Optimizer], dht: Optional[hivemind.DHT]) -> None:
    """Idempotent: the training thread and a stopping main thread may both call it."""
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


def announce(dht: hivemind.DHT, run_id: str, peer_id: str, info: dict, timeout_s: float = 5.0) -> bool:
    now = get_dht_time()
    future = dht.store(_nodes_key(run_id), dict(info, time=now), now + NODES_TTL_S, subkey=peer_id,
                       return_future=True)
    try:
        return bool(future.result(timeout_s))
    except Exception as e:
        logger.warning(f"Announcing this node failed: {e!r}")
        return False


def list_nodes(dht: hivemind.DHT, run_id: str, timeout_s: float = 5.0) -> dict[str, dict]:
    """peer id -> the info it announced, for every node seen in the last NODES_TTL_S."""
    future = dht.get(_nodes_key(run_id), latest=True, return_future=True)
    try:
        found = future.result(timeout_s)
    except Exception as e:
        logger.warning(f"Listing swarm nodes failed: {e!r}")
        return {}
    if found is None or not isinstance(found.value, dict):
        return {}
    return {str(k): v.value for k, v in found.value.items() if isinstance(v.value, dict)}
