"""What `/api/v1/swarm/status` and the dashboard read of a node: one consistent look at it
(node.train.trainer.TrainingNode.status)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dtrain.node.swarm.presence import PeerInfo


@dataclass(frozen=True)
class NodeStatus:
    """One consistent look at the node, for `/api/v1/swarm/status` and the dashboard."""

    step: int
    updates: int
    params_sha256: str
    peer_id: str
    maddrs: tuple[str, ...]
    peers: int  # nodes in the swarm, idle or not
    training_peers: int  # peers accumulating samples, as hivemind's progress records show
    nodes: tuple[PeerInfo, ...]
    contributors: int  # distinct contributors ever accepted by this node
    pending_contributors: int  # in the group being gathered toward min_nodes_for_update
    accepted_packets: int
    accepted_samples: int
    applied_packets: int  # of the accepted ones, applied by an update of the swarm
    applied_samples: int  # includes the node's own data
    carried_packets: int  # missed at least one update and went into a later one
    carried_samples: int
    pending_samples: int  # handed to the training thread, not applied yet
    last_update_s: float  # how long the last update took (0 before the first)
    reachability: dict  # node.swarm.reachability.Reachability.as_dict(): full or client-mode peer, and why
    skipped_rounds: int  # gradient rounds that failed and made no update (client mode, low-comm): nothing lost
    references: int = 0  # trusted reference gradients computed (one per step with contributions)
    reference_seconds: float = 0.0  # their total wall time
    scored_out: int = 0  # contributors the ledger refuses for their record
    closed: bool = False  # --swarm-key: only peers that hold the key can join (docs/peers.md)
    sync: str = "per-step"  # how the swarm syncs: per-step or low-comm (docs/low-communication.md)
    wire_codec: Optional[str] = None  # low-comm: fp16, fp32 or sparse
    device: Optional[dict] = None  # node.device.Device.as_dict(): where passes run (cpu, cuda:N) and at what precision
    # how the state of the node's first served step came: "founder" (it started the swarm), "checkpoint" (its
    # --checkpoint-dir held the swarm's bytes), "own state" (a joiner at epoch 0 that built the swarm's start
    # itself: no download), "download" (from peers)
    first_state: str = ""
    round_samples: int = 0  # low-comm: samples of the node's own data trained while outer rounds ran (node.train.ahead)
    torch_threads: Optional[dict] = None  # node.device.threads_now(): torch's CPU threads per operation (--torch-threads)
