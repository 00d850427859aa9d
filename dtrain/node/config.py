"""Configuration dataclasses: the model, the optimizer and the node process.

Files in `static/` and `configs/` load into these; every `dtrain-node` flag maps onto a field.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from dtrain.node.assets import DEFAULT_STATIC_DIR
from dtrain.node.options import option
from dtrain.node.serve.config import ServeConfig
from dtrain.node.split.config import SplitConfig



class ConfigError(ValueError):
    """A configuration file or flag is invalid; the message says which field and why."""


def _from_mapping(cls, data: dict, source: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {unknown}; expected some of {sorted(names)}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ConfigError(f"{source}: {e}") from None


@dataclass(frozen=True)
class ModelConfig:
    """GPT-2-style causal LM shape, as `static/model_config.json` spells it."""

    vocab_size: int = 50257  # tokens in the GPT-2 vocabulary
    d_model: int = 256  # hidden size
    n_heads: int = 4  # attention heads per block
    n_layers: int = 4  # transformer blocks
    d_ff: int = 1024  # inner size of each MLP
    max_seq_len: int = 256  # learned positions
    seed: int = 1234  # initialisation seed: every fresh swarm starts from the same parameters
    name: str = "dtrain-gpt2"  # informational model name

    def __post_init__(self):
        for key in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model config: {key} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model config: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")

    @classmethod
    def load(cls, path: Path | str) -> "ModelConfig":
        return _from_mapping(cls, _read_json(path), str(path))

    def architecture(self) -> dict[str, int]:
        """What makes two models the same shape (the name and the seed do not)."""
        return {k: getattr(self, k) for k in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len")}


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer settings: the `train` block of the API (`static/train_config.json`)."""

    learning_rate: float = 3e-4  # AdamW step size
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.999  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    min_nodes_for_update: int = 1  # distinct contributors before a node hands its bridge gradient to the swarm

    def __post_init__(self):
        if not isinstance(self.min_nodes_for_update, int) or self.min_nodes_for_update < 1:
            raise ConfigError(f"train config: min_nodes_for_update must be >= 1, got {self.min_nodes_for_update!r}")
        if not self.learning_rate > 0:
            raise ConfigError(f"train config: learning_rate must be > 0, got {self.learning_rate!r}")

    @classmethod
    def load(cls, path: Path | str) -> "TrainConfig":
        return _from_mapping(cls, _read_json(path), str(path))


@dataclass(frozen=True)
class SwarmConfig:
    """How the node joins the hivemind swarm and when the swarm updates."""

    initial_peers: Sequence[str] = option((), "--initial-peers", "multiaddrs of running peers; none starts a new swarm",
                                          nargs="+")  # any running peer's multiaddrs
    host_maddrs: Sequence[str] = option(("/ip4/0.0.0.0/tcp/0",), "--host-maddrs", "libp2p listen multiaddrs",
                                        nargs="+")  # where libp2p listens
    announce_maddrs: Sequence[str] = option((), "--announce-maddrs", "multiaddrs to advertise to peers (behind NAT)",
                                            nargs="+")  # addresses to advertise instead of the listening ones
    identity_path: Optional[str] = option(None, "--identity-path",
                                          "libp2p private key file for a stable peer id (created if missing)")
    run_id: str = option("dtrain", "--run-id", "swarm name; peers with the same run id train together")
    # a closed swarm (docs/peers.md): only peers holding the same key join its DHT and its averaging
    swarm_key_path: Optional[str] = option(None, "--swarm-key", "file of at least 32 secret bytes shared by the "
                                           "swarm's peers (`head -c 32 /dev/urandom > swarm.key`); only peers "
                                           "holding it can join (default: an open swarm)")
    # an update begins once the swarm gathered this many samples (or they stopped growing for settle_s)
    target_batch_size: int = option(1, "--target-batch-size",
                                    "samples that start an update at once (1: any pending sample)")
    settle_s: float = option(2.0, "--settle-time", "an update also begins once the swarm's pending samples stopped "
                                                    "growing this long, seconds")  # keeps the pace when a peer leaves
    matchmaking_time_s: float = option(5.0, "--matchmaking-time", "seconds to gather an averaging group "
                                                                  "(must exceed --request-timeout)")
    averaging_timeout_s: float = option(30.0, "--averaging-timeout", "the shortest deadline of one all-reduce "
                                        "round, seconds; it grows to fit a round's bytes at the throughput earlier "
                                        "rounds measured (and in low-comm at --link-mbit)")
    request_timeout_s: float = option(3.0, "--request-timeout", "bound on one averaging RPC, seconds")
    load_state_timeout_s: float = 120.0  # bound on downloading state from a peer, seconds
    # how the node joins (docs/home-nodes.md): a full peer that others dial, or a client-mode peer that dials out
    reachability: str = option("auto", "--reachability", "auto: ask the initial peers to dial this node back and "
                               "join as a client-mode peer if none can; public: a full peer; client: a client-mode "
                               "peer (behind NAT, dials out only)", choices=("auto", "public", "client"))
    relay: bool = option(True, "--no-relay", "use no libp2p relays", without="peers may dial this node through a "
                         "public peer acting as relay, and a client-mode node looks for one", action="store_false",
                         dest="relay")

    # how the swarm syncs (docs/low-communication.md): every update all-reduces the gradient and the optimizer
    # state, or rounds of inner updates on each node, then one all-reduce of the pseudo-gradients
    sync: str = option("low-comm", "--sync", "per-step: every update averages gradients, parameters and Adam "
                       "moments; low-comm: --inner-steps AdamW updates on each node, then one averaged outer "
                       "Nesterov step", choices=("per-step", "low-comm"))
    inner_steps: int = option(10, "--inner-steps", "low-comm: inner updates of a node between outer rounds")
    # a served step comes at most once per outer round: on a GPU ten inner updates take well under a second, and a
    # browser that needs seconds for a packet would find the node more than five steps further (409)
    min_round_s: Optional[float] = option(None, "--min-round-seconds", "low-comm: a node's outer round is due "
                                          "once it made --inner-steps inner updates and this many seconds passed "
                                          "since the round's first one (default: 0 on a CPU, 15 on a GPU)")
    # an outer round waits for the other nodes, the group and the payloads over the link (node.train.ahead)
    train_in_rounds: bool = option(True, "--no-train-in-rounds", "low-comm: train no local batch while an outer "
                                   "round runs", without="a node with peers trains its next local batches while its "
                                   "round runs: one inner update's allowance, which makes the next round's first "
                                   "inner update, or, where the inner loop trains a copy of its own (a GPU, "
                                   "--inner-copy), inner updates of the copy, as many as it made before the round",
                                   action="store_false", dest="train_in_rounds")
    # on a GPU the inner loop always trains a copy of its own, on the device (node.train.compute.Compute.resident)
    inner_copy: bool = option(False, "--inner-copy", "low-comm on the CPU: the inner loop trains a copy of the model "
                              "of its own, as on a GPU, so that its inner updates go on while an outer round runs "
                              "(as many as it made before the round; P more memory, P the fp32 parameters)",
                              without="on the CPU the inner loop trains the parameters the swarm shares, and a round "
                              "trains one inner update's batches", action="store_true", dest="inner_copy")
    outer_lr: float = option(0.7, "--outer-lr", "low-comm: outer Nesterov SGD learning rate")
    outer_momentum: float = option(0.9, "--outer-momentum", "low-comm: outer Nesterov SGD momentum")
    wire_codec: str = option("sparse", "--wire-codec", "low-comm: the pseudo-gradient on the wire: fp16 or fp32 "
                             "(dense all-reduce, then the parameters are averaged), or sparse (top-k with error "
                             "feedback, exchanged member to member: every node computes the same average)",
                             choices=("fp16", "fp32", "sparse"))
    topk_fraction: float = option(0.2, "--topk-fraction", "low-comm, sparse codec: the fraction of each tensor's "
                                  "elements a round sends; the rest waits in the node's error feedback")
    link_mbit: float = option(10.0, "--link-mbit", "low-comm: the slowest link's rate, Mbit/s (default: a home "
                              "uplink); the all-reduce deadline grows to fit its bytes at this rate or the measured "
                              "one, whichever is slower (0: the measured one only)")
    # a joiner's first download (docs/low-communication.md, "Joining from several donors"): in ranges from several
    # donors at once, resumed when one fails; every node then also serves ranges of its state (in place: no copy)
    state_donors: int = option(3, "--state-donors", "low-comm, sparse codec: a joiner downloads the state in ranges "
                               "from up to this many peers at once, and a donor that fails loses its ranges to the "
                               "others; the node serves ranges of its state too (0: one peer, through hivemind's "
                               "download, and the node serves no ranges)")

    # a donor's bound on the state it serves to downloading peers, so that its own rounds and records keep flowing
    serve_state_mbit: float = option(0.0, "--serve-state-mbit", "Mbit/s this node streams its state to downloading "
                                     "peers at, at most, all of them together (0: no bound; docs/low-communication.md, "
                                     "\"How a node joins\")")

    def __post_init__(self):
        if self.sync not in ("per-step", "low-comm"):
            raise ConfigError(f"sync must be per-step or low-comm, got {self.sync!r}")
        if not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ConfigError(f"inner_steps must be an integer >= 1, got {self.inner_steps!r}")
        if self.inner_copy and self.sync != "low-comm":
            raise ConfigError("inner_copy (--inner-copy) is an option of --sync low-comm: per-step mode has no inner "
                              "loop")
        if self.min_round_s is not None and not 0 <= self.min_round_s <= 3600:
            raise ConfigError(f"min_round_s must be in [0, 3600] seconds, got {self.min_round_s!r}")
        if not self.outer_lr > 0 or not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"outer_lr must be > 0 and outer_momentum in [0, 1), got {self.outer_lr!r}, "
                              f"{self.outer_momentum!r}")
        if self.wire_codec not in ("fp16", "fp32", "sparse"):
            raise ConfigError(f"wire_codec must be fp16, fp32 or sparse, got {self.wire_codec!r}")
        if not 0.0 < self.topk_fraction <= 1.0:
            raise ConfigError(f"topk_fraction must be in (0, 1], got {self.topk_fraction!r}")
        if not isinstance(self.state_donors, int) or self.state_donors < 0:
            raise ConfigError(f"state_donors must be an integer >= 0, got {self.state_donors!r}")
        if not (self.serve_state_mbit >= 0 and self.serve_state_mbit < float("inf")):
            raise ConfigError(f"serve_state_mbit must be a finite number >= 0 (0: no bound), got {self.serve_state_mbit!r}")
        if not self.link_mbit >= 0:
            raise ConfigError(f"link_mbit must be >= 0 (0: unknown), got {self.link_mbit!r}")
        if self.swarm_key_path is not None and not str(self.swarm_key_path).strip():
            # an empty value (an unset variable in a script, say) must not quietly leave the swarm open
            raise ConfigError("swarm_key_path is empty: give the key file's path, or leave the option out for an "
                              "open swarm")
        if self.reachability not in ("auto", "public", "client"):
            raise ConfigError(f"reachability must be auto, public or client, got {self.reachability!r}")
        if self.matchmaking_time_s <= self.request_timeout_s:
            raise ConfigError(
                f"matchmaking_time ({self.matchmaking_time_s}s) must exceed request_timeout ({self.request_timeout_s}s);"
                " hivemind stalls when they are equal"
            )
        if self.target_batch_size < 1:
            raise ConfigError("target_batch_size must be >= 1")
        if not self.settle_s > 0:
            raise ConfigError(f"settle_s must be > 0 seconds, got {self.settle_s!r}")


@dataclass(frozen=True)
class NodeConfig:
    """Everything one `dtrain-node` process runs with."""

    host: str = option("0.0.0.0", "--host", "bridge listen address")
    port: int = option(8095, "--port", "bridge HTTP port")
    static_dir: str = option(str(DEFAULT_STATIC_DIR), "--static-dir",
                             "configs, tokenizer files and pages served under /static/")
    model_config: Optional[str] = option(None, "--model-config",
                                         "model config JSON (default <static-dir>/model_config.json)")
    init_from: Optional[str] = option(None, "--init-from", "start a new swarm from a Hugging Face GPT-2 directory "
                                      "(config.json and model.safetensors or pytorch_model.bin): its shape, weights "
                                      "and tokenizer files; a node that joins a swarm still takes the swarm's state",
                                      metavar="DIR")
    train_config: Optional[str] = option(None, "--train-config",
                                         "optimizer config JSON (default <static-dir>/train_config.json)")
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    checkpoint_dir: Optional[str] = option(None, "--checkpoint-dir",
                                           "save state here every --checkpoint-every updates and on shutdown")
    checkpoint_every: int = option(10, "--checkpoint-every", "updates between checkpoints")
    train_data: Optional[str] = option(None, "--train-data",
                                       "local text file: the node trains on it and hands out batches")
    serve_data: bool = option(True, "--no-data", "hand out no /api/v1/data/batch", without="the node hands out "
                              "batches of --train-data, else of the default corpus, which it never trains on",
                              action="store_false", dest="serve_data")
    local_batch_size: int = option(8, "--local-batch-size", "sequences per local training step")
    local_seq_len: int = option(64, "--local-seq-len", "tokens per sequence of local training and handed-out batches")
    local_samples_per_update: int = option(0, "--local-samples-per-update",
                                           "own-data samples per update (low-comm: per inner update), then "
                                           "wait for the swarm (0: no cap)")
    wait_for_peers: int = option(1, "--wait-for-peers", "train on local data only once this many nodes (this one "
                                 "included) have joined the swarm, so that a run starts from one state on every "
                                 "node; browsers' packets are taken meanwhile (1: at once)")
    log_level: str = option("INFO", "--log-level", "DEBUG, INFO, WARNING")
    # where forward and backward passes run (training, /v1, split inference); the swarm's fp32 state stays on the
    # CPU whatever it is (docs/spec/NOTES.md, "Device")
    device: str = option("auto", "--device", "auto: the first CUDA GPU when torch sees one, else the CPU; cpu; "
                         "cuda or cuda:N (a GPU index). On a GPU the node trains with bf16 autocast over fp32 master "
                         "weights and serves the same fp32 bytes")
    # one budget for every torch op on the CPU, set once at start (node.device.use_threads, docs/serving.md)
    torch_threads: int = option(0, "--torch-threads", "threads one torch operation on the CPU may use, for every "
                                "engine of the node: training, /v1, split inference, feedback and adapter scoring "
                                "(0: torch's default, one per core it sees)")
    # untrusted contributors (docs/robustness.md)
    max_samples_per_packet: int = option(256, "--max-samples-per-packet",
                                         "samples one packet may claim; above it the packet is refused with 400")
    rate_limit_per_s: float = option(5.0, "--rate-limit", "packets per second per contributor (0: no limit); "
                                                          "above it 429 with Retry-After")
    rate_burst: int = option(30, "--rate-burst", "packets a contributor may send back to back")
    contributor_tokens: Optional[str] = option(None, "--contributor-tokens", "file of bearer tokens, one per line: "
                                               "only contributors sending one are accepted (default: open)")
    aggregation: str = option("centered_clip", "--aggregation", "how one hand-over's contributions combine: "
                              "centered_clip, trimmed_mean or mean (weight and norm bounds only)")
    norm_bound: Optional[float] = option(None, "--norm-bound", "fixed L2 bound of one contribution's gradient "
                                                               "(default: 4x the running median norm)")
    min_cosine: Optional[float] = option(None, "--min-cosine", "direction check: a contribution whose cosine with the "
                                         "reference direction is not above this counts with weight 0 (default: 0 "
                                         "against the node's own gradient; with --reference-batch 0 off, or against "
                                         "the Adam momentum when given, e.g. -0.05)")
    reference_batch: int = option(4, "--reference-batch", "sequences of the node's own data (--train-data, else the "
                                  "packaged corpus) whose gradient is the trusted reference each contribution is "
                                  "judged against, once per step (0: no reference)")
    max_weight_multiple: float = option(4.0, "--max-weight-multiple", "a packet counts with at most this multiple of "
                                        "the median samples contributors claim (a new contributor: 1x until its "
                                        "record agrees with the reference; 0: off)")
    contributor_scoring: bool = option(True, "--no-contributor-scoring", "keep no per-contributor record of "
                                       "agreement with the reference", without="a persistently disagreeing "
                                       "contributor is refused with 403, new ones ramp up",
                                       action="store_false", dest="contributor_scoring")
    # memory: accepted packets wait in the node's pool until its training thread takes them (during an update it
    # takes none); many node_ids may pile up packets meanwhile
    max_pending_mib: int = option(512, "--max-pending-mib", "MiB of accepted packets a node holds before its "
                                  "training thread takes them; above it a packet is refused with 503 and "
                                  "Retry-After (0: no bound)")
    split: SplitConfig = field(default_factory=SplitConfig)  # split-inference options
    serve: ServeConfig = field(default_factory=ServeConfig)  # the OpenAI-compatible API, capture and feedback

    def __post_init__(self):
        if self.init_from is not None and self.model_config is not None:
            raise ConfigError("--init-from takes the model's shape from the directory's config.json; drop "
                              "--model-config")
        if not isinstance(self.max_pending_mib, int) or self.max_pending_mib < 0:
            raise ConfigError(f"max_pending_mib must be an integer >= 0 (0: no bound), got {self.max_pending_mib!r}")
        if not 0 <= self.reference_batch <= 256:
            raise ConfigError(f"reference_batch must be in [0, 256] sequences (0: no reference), "
                              f"got {self.reference_batch!r}")
        if not isinstance(self.wait_for_peers, int) or self.wait_for_peers < 1:
            raise ConfigError(f"wait_for_peers must be an integer >= 1 (1: at once), got {self.wait_for_peers!r}")
        if not self.max_weight_multiple >= 0:
            raise ConfigError(f"max_weight_multiple must be >= 0 (0: off), got {self.max_weight_multiple!r}")
        parse_device(self.device)
        if not isinstance(self.torch_threads, int) or self.torch_threads < 0:
            raise ConfigError(f"torch_threads must be an integer >= 0 (0: torch's default), got {self.torch_threads!r}")

    @property
    def max_pending_bytes(self) -> Optional[int]:
        """The pool's byte bound (node.pool.ContributionPool); None: no bound."""
        return self.max_pending_mib << 20 if self.max_pending_mib else None

    def model_config_path(self) -> Path:
        return Path(self.model_config) if self.model_config else Path(self.static_dir) / "model_config.json"

    def train_config_path(self) -> Path:
        return Path(self.train_config) if self.train_config else Path(self.static_dir) / "train_config.json"


_DEVICE = re.compile(r"(auto|cpu|cuda)(?::(\d{1,3}))?")


def parse_device(text: str) -> tuple[str, Optional[int]]:
    """`--device`'s value as (kind, GPU index or None): auto, cpu, cuda or cuda:N. Only the spelling is checked
    here; whether that GPU exists is node.device.resolve's question, asked before the node starts."""
    match = _DEVICE.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N (N a GPU index, e.g. cuda:0), got {text!r}")
    return match.group(1), None if match.group(2) is None else int(match.group(2))


def _read_json(path: Path | str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data
