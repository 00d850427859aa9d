"""The node's hold on the hivemind swarm: its DHT and the collaborative optimizer around the model's optimizer.

`Swarm` owns both and their shutdown, and decides at start whether the node joins as a full peer or, when the swarm
cannot dial it, as a client-mode peer (node.swarm.reachability). The optimizer is node.swarm.optimizer's
SwarmOptimizer, with node.swarm.tracker's rule for when an update begins.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Optional, Sequence

import hivemind
import torch
from hivemind.p2p import P2P
from hivemind.utils.logging import get_logger

from dtrain.node import memory
from dtrain.node.swarm.commit import CommittingGradientAverager, chunk_timeout
from dtrain.node.swarm.deadlines import RoundClock
from dtrain.node.swarm.keygate import start_prover
from dtrain.node.swarm.others import Others
from dtrain.node.swarm.presence import presence_validator
from dtrain.node.swarm.records import RecordOwner, identity_kwargs
from dtrain.node.swarm.swarmkey import SwarmJoinError, SwarmKeyAuthorizer, keyed_run_id, load_swarm_key
from dtrain.node.swarm.reachability import Reachability, ReachabilityService, decide
from dtrain.node.swarm.service import NodeService
from dtrain.node.swarm.optimizer import SwarmOptimizer, peer_bonus
from dtrain.node.swarm.state import keep_state_shared
from dtrain.node.config import SwarmConfig

logger = get_logger(__name__)

# the tracker looks for fresh swarm progress at least this often: it bounds how far apart peers begin an update
TRACKER_MAX_REFRESH_S = 1.0
SHUTDOWN_TIMEOUT_S = 5.0  # how long hivemind may take to leave the swarm when stopped under an update


@contextlib.contextmanager
def _closed_join(closed: bool):
    """In a closed swarm, hivemind's "bootstrap failed" also means that the initial peers hold another key: say so."""
    try:
        yield
    except RuntimeError as e:
        if closed and "bootstrap failed" in str(e):
            raise SwarmJoinError(f"{e}: in a closed swarm, none of the initial peers answered with this --swarm-key "
                                 f"(they are unreachable, or hold another key or none)") from None
        raise


@dataclass(frozen=True)
class Averaging:
    """How the swarm's gradient rounds average: the gradient averager's class (given the node's record key and swarm
    key) and hivemind.Optimizer's arguments for them. This one is per-step mode's: every node applies the same
    averaged update, the gradients all-reduced, then the parameters and Adam moments (delay_state_averaging=False
    keeps state averaging inside the update). Low-comm's: node.lowcomm.codec.averaging."""

    averager: Callable[..., CommittingGradientAverager] = CommittingGradientAverager
    optimizer_kwargs: Mapping[str, Any] = field(
        default_factory=lambda: dict(average_state_every=1, average_opt_statistics=("exp_avg", "exp_avg_sq")))
    failed_rounds_carried: int = 0  # failed rounds in a row that make no update (SwarmOptimizer)


class Swarm:
    """The DHT and the collaborative optimizer of one node, and their bounded shutdown."""

    def __init__(self, config: SwarmConfig, local_optimizer: torch.optim.Optimizer,
                 local_gradients: Callable[[], Sequence[torch.Tensor]], verbose: bool = False,
                 averaging: Averaging = Averaging(), round_clock: Optional[RoundClock] = None,
                 others: Optional[Others] = None, round_due: Optional[Callable[[], bool]] = None,
                 before_state_load: Optional[Callable[[], None]] = None):
        """`averaging`: how the gradient rounds average (per-step mode's by default). `round_clock`: keeps the
        all-reduce deadline from each round's measured throughput (node.swarm.deadlines); None:
        `config.averaging_timeout_s` throughout. `local_gradients`, `others` (node.swarm.others), `round_due`
        and `before_state_load`: what the node tells its optimizer (node.swarm.optimizer.SwarmOptimizer)."""
        self.config = config
        # a closed swarm: the key is read (or refused) before anything starts; the run's DHT keys are then named
        # with it, and every DHT request and response carries its HMAC (node.swarm.swarmkey)
        swarm_key = load_swarm_key(config.swarm_key_path) if config.swarm_key_path is not None else None
        self.run_id = keyed_run_id(swarm_key, config.run_id) if swarm_key else config.run_id
        self.closed = swarm_key is not None
        identity_path = config.identity_path
        fresh = bool(identity_path) and not os.path.exists(identity_path)
        if fresh:
            P2P.generate_identity(identity_path)  # a stable peer id across restarts
            logger.info(f"Generated a new libp2p identity in {identity_path}")
        # the node's records are signed with its libp2p identity, so a record's subkey names its peer
        # (node.swarm.records); without --identity-path a fresh one is made for this run
        self.owner = RecordOwner.from_identity(identity_path) if identity_path else RecordOwner.generate()
        # asked before the DHT starts: hivemind's client mode is chosen when a peer is created
        self.reachability: Reachability = decide(config.reachability, config.relay, config.initial_peers,
                                                 config.host_maddrs, config.announce_maddrs, swarm_key=swarm_key)
        logger.info(self.reachability.describe())
        client = self.reachability.mode == "client"
        keep_state_shared(local_optimizer)  # before hivemind forks its first process, and can hand the state out
        memory.trim()  # what the moves to shared memory freed is not inherited by the forks either
        with identity_kwargs(self.owner, identity_path, fresh) as identity, _closed_join(self.closed):
            self.dht = hivemind.DHT(
                initial_peers=list(config.initial_peers),
                host_maddrs=list(config.host_maddrs),
                announce_maddrs=list(config.announce_maddrs) or None,
                client_mode=client,
                use_relay=config.relay,
                use_auto_relay=config.relay and client,
                record_validators=[self.owner.validator, presence_validator(self.run_id)],
                authorizer=SwarmKeyAuthorizer(swarm_key) if swarm_key else None,
                start=True,
                **identity,
            )
        self.optimizer: Optional[SwarmOptimizer] = None
        self.service: Optional[NodeService] = None
        self._shut_down = threading.Event()
        try:
            if swarm_key:  # answer the challenges of peers' gated RPCs (node.swarm.keygate)
                start_prover(self.dht, swarm_key)
            # the node's own RPCs; a client-mode peer is asked no dial-back: nobody can dial it
            self.service = NodeService(self.dht, swarm_key) if client else ReachabilityService(self.dht, swarm_key)
            self.peer_id = str(self.dht.peer_id)
            if self.peer_id != self.owner.peer_id:  # records would name another peer than the one that wrote them
                raise RuntimeError(f"p2pd runs as {self.peer_id}, not as the record key's peer {self.owner.peer_id}")
            self.maddrs = [str(addr) for addr in self.dht.get_visible_maddrs()]
            averager = partial(averaging.averager, record_subkey=self.owner.subkey, swarm_key=swarm_key)
            self.optimizer = SwarmOptimizer(
                local_gradients=local_gradients,
                others=others,
                round_due=round_due,
                before_state_load=before_state_load,
                update_bonus=peer_bonus(self.peer_id),
                failed_rounds_carried=averaging.failed_rounds_carried,
                swarm_key=swarm_key,
                settle_s=config.settle_s,
                dht=self.dht,
                run_id=self.run_id,
                target_batch_size=config.target_batch_size,
                optimizer=local_optimizer,
                matchmaking_time=config.matchmaking_time_s,
                averaging_timeout=config.averaging_timeout_s,
                next_chunk_timeout=chunk_timeout(config.averaging_timeout_s),  # also bounds a state download's chunks
                load_state_timeout=config.load_state_timeout_s,
                delay_state_averaging=False,
                client_mode=client,  # hivemind 1.1.12 takes the DHT's mode when this is given at all
                reuse_grad_buffers=True,  # the node writes the exact samples-weighted gradient into .grad itself
                # a gradient round is applied whole or not at all; members' outcomes are signed records
                grad_averager_factory=averager,
                **{"average_state_every": 1, **averaging.optimizer_kwargs},
                averager_opts=dict(request_timeout=config.request_timeout_s),
                # the tracker signs its progress records with the DHT's one record key (hivemind keeps the first
                # RSASignatureValidator a DHT is given and ignores later ones)
                tracker_opts=dict(min_refresh_period=0.2, max_refresh_period=TRACKER_MAX_REFRESH_S,
                                  default_refresh_period=0.5, private_key=self.owner.private_key),
                verbose=verbose,
            )
            self.optimizer.round_clock = round_clock
        except BaseException:
            self.shutdown()
            raise

    @property
    def client_mode(self) -> bool:
        return self.reachability.mode == "client"

    @property
    def epoch(self) -> int:
        return self.optimizer.local_epoch

    def wait_for_progress(self, timeout_s: float) -> bool:
        """Bounded wait for the tracker's first look at the swarm's progress (so global_epoch is real), asked for
        now."""
        tracker = self.optimizer.tracker
        tracker.read_now()
        return tracker.fetched_global_progress_this_epoch.wait(timeout_s)

    def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """Idempotent: the training thread and a stopping main thread may both call it.

        hivemind's own shutdown waits on an all-reduce in flight and then on each process's grace period in turn
        (more than 15 s seen here). With `timeout_s` it gets that long; then hivemind's processes still alive are
        terminated, which is what hivemind itself does when a grace period runs out.
        """
        if timeout_s is None:
            self._shut_down_once()
            return
        deadline = time.monotonic() + timeout_s
        threading.Thread(target=self._shut_down_once, name="dtrain-shutdown", daemon=True).start()
        averagers = (getattr(self.optimizer, "grad_averager", None), getattr(self.optimizer, "state_averager", None))
        processes = [p for p in (*averagers, self.dht) if p is not None]
        # wait for the processes, not the thread: another thread may be inside the graceful shutdown already
        while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        for process in processes:
            if process.is_alive():
                logger.warning(f"{type(process).__name__} did not shut down within {timeout_s:.0f}s; terminating it")
                process.terminate()

    def _shut_down_once(self) -> None:
        if self._shut_down.is_set():
            return
        self._shut_down.set()
        for part in (self.service, self.optimizer, self.dht):  # the DHT last: it also stops the p2pd child process
            if part is None:
                continue
            try:
                part.shutdown()
            except Exception as e:
                logger.warning(f"Shutting down {type(part).__name__} failed: {e!r}")
