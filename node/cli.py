"""`dtrain-node`: parse flags (and an optional YAML/JSON file) into a NodeConfig, then run the node."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from hivemind.utils.logging import get_logger, use_hivemind_log_handler

from node.config import ConfigError, ModelConfig, NodeConfig, SwarmConfig, TrainConfig
from node.split.config import SplitConfig, parse_expert_flag

logger = get_logger(__name__)

# flag -> (dataclass, field); SwarmConfig fields live in NodeConfig.swarm
_SWARM_FLAGS = {
    "initial_peers": "initial_peers",
    "host_maddrs": "host_maddrs",
    "announce_maddrs": "announce_maddrs",
    "identity_path": "identity_path",
    "run_id": "run_id",
    "target_batch_size": "target_batch_size",
    "matchmaking_time": "matchmaking_time_s",
    "averaging_timeout": "averaging_timeout_s",
    "request_timeout": "request_timeout_s",
}
_NODE_FLAGS = {
    "host": "host",
    "port": "port",
    "static_dir": "static_dir",
    "model_config": "model_config",
    "train_config": "train_config",
    "checkpoint_dir": "checkpoint_dir",
    "checkpoint_every": "checkpoint_every",
    "train_data": "train_data",
    "serve_data": "serve_data",
    "local_batch_size": "local_batch_size",
    "local_seq_len": "local_seq_len",
    "local_samples_per_update": "local_samples_per_update",
    "log_level": "log_level",
}
# SplitConfig fields live in NodeConfig.split
_SPLIT_FLAGS = {
    "split_max_sessions": "max_sessions",
    "split_session_ttl": "session_ttl_s",
    "dp_clip": "dp_clip",
    "dp_epsilon": "dp_epsilon",
    "dp_delta": "dp_delta",
    "expert": "experts",
    "he": "he",
    "split_model": "split_model",
    "split_max_frame_bytes": "max_frame_bytes",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dtrain-node",
        description="Run one node of a dtrain swarm: hivemind peer, Training API v1 bridge and split inference.",
    )
    p.add_argument("--config", help="YAML or JSON file with any of the options below (flags override it)")
    g = p.add_argument_group("swarm")
    g.add_argument("--initial-peers", nargs="+", help="multiaddrs of running peers; none starts a new swarm")
    g.add_argument("--host-maddrs", nargs="+", help="libp2p listen multiaddrs (default /ip4/0.0.0.0/tcp/0)")
    g.add_argument("--announce-maddrs", nargs="+", help="multiaddrs to advertise to peers")
    g.add_argument("--identity-path", help="libp2p private key file for a stable peer id (created if missing)")
    g.add_argument("--run-id", help="swarm name; peers with the same run id train together (default dtrain)")
    g.add_argument("--target-batch-size", type=int, help="samples the swarm gathers per update (default 1: each bridge hand-over is an update)")
    g.add_argument("--matchmaking-time", type=float, help="seconds to gather an averaging group (default 5)")
    g.add_argument("--averaging-timeout", type=float, help="bound on one all-reduce, seconds (default 30)")
    g.add_argument("--request-timeout", type=float, help="bound on one averaging RPC, seconds (default 3)")
    g = p.add_argument_group("node")
    g.add_argument("--host", help="bridge listen address (default 0.0.0.0)")
    g.add_argument("--port", type=int, help="bridge port (default 8095)")
    g.add_argument("--static-dir", help="directory served under /static/ (default the package's static/)")
    g.add_argument("--model-config", help="model config JSON (default <static-dir>/model_config.json)")
    g.add_argument("--train-config", help="optimizer config JSON (default <static-dir>/train_config.json)")
    g.add_argument("--checkpoint-dir", help="save state here every --checkpoint-every updates and on shutdown")
    g.add_argument("--checkpoint-every", type=int, help="updates between checkpoints (default 10)")
    g.add_argument("--train-data", help="local text file: the node trains on it and hands out batches "
                   "(default: hands out batches of the default corpus, and trains on none itself)")
    g.add_argument("--no-data", dest="serve_data", action="store_false", default=None,
                   help="hand out no /api/v1/data/batch (contributors bring their own text)")
    g.add_argument("--local-batch-size", type=int, help="sequences per local training step (default 8)")
    g.add_argument("--local-seq-len", type=int, help="tokens per sequence (default 64)")
    g.add_argument("--local-samples-per-update", type=int,
                   help="own-data samples per update, then wait for the swarm (default 0: no cap)")
    g.add_argument("--log-level", help="DEBUG, INFO, WARNING (default INFO)")
    g = p.add_argument_group("split inference")
    g.add_argument("--split-max-sessions", type=int, help="KV-cached split sessions kept at once (default 32)")
    g.add_argument("--split-session-ttl", type=float, help="seconds an idle split session is kept (default 300)")
    g.add_argument("--dp-clip", type=float, help="L2 clipping bound of each returned hidden state (default 1)")
    g.add_argument("--dp-epsilon", type=float, help="DP epsilon per forward call; 0 turns noise off (default 0)")
    g.add_argument("--dp-delta", type=float, help="DP delta (default 1e-5)")
    g.add_argument("--expert", action="append", metavar="NAME=PATH",
                   help="host a LoRA expert saved by LoraExpert.save / examples/train_expert.py (repeatable)")
    g.add_argument("--no-he", dest="he", action="store_false", default=None,
                   help="compute expert deltas in plaintext only (no CKKS keys)")
    g.add_argument("--split-model", metavar="PATH",
                   help="serve this local transformers causal-LM directory (frozen) instead of the shared model")
    g.add_argument("--split-max-frame-bytes", type=int,
                   help="largest split request, bytes (default: enough for the model's max sequence)")
    return p


def _load_file(path: str) -> dict:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


def parse_config(argv: Optional[Sequence[str]] = None) -> NodeConfig:
    args = build_parser().parse_args(argv)
    values = _load_file(args.config) if args.config else {}
    unknown = sorted(set(values) - set(_SWARM_FLAGS) - set(_NODE_FLAGS) - set(_SPLIT_FLAGS))
    if unknown:
        raise ConfigError(f"{args.config}: unknown option(s) {unknown}")
    for name, value in vars(args).items():
        if name != "config" and value is not None:
            values[name] = value
    swarm_kwargs = {_SWARM_FLAGS[k]: v for k, v in values.items() if k in _SWARM_FLAGS}
    for key in ("initial_peers", "host_maddrs", "announce_maddrs"):
        if isinstance(swarm_kwargs.get(key), str):
            swarm_kwargs[key] = [swarm_kwargs[key]]
        if key in swarm_kwargs:
            swarm_kwargs[key] = tuple(swarm_kwargs[key])
    node_kwargs = {_NODE_FLAGS[k]: v for k, v in values.items() if k in _NODE_FLAGS}
    return NodeConfig(swarm=SwarmConfig(**swarm_kwargs), split=_split_config(values), **node_kwargs)


def _split_config(values: dict) -> SplitConfig:
    kwargs = {_SPLIT_FLAGS[k]: v for k, v in values.items() if k in _SPLIT_FLAGS}
    experts = kwargs.get("experts")
    if experts is not None:
        # flags give ["NAME=PATH", ...]; a config file may also give {NAME: PATH}
        items = experts.items() if isinstance(experts, dict) else [
            parse_expert_flag(e) if isinstance(e, str) else tuple(e) for e in ([experts] if isinstance(experts, str) else experts)
        ]
        kwargs["experts"] = tuple((str(name), str(path)) for name, path in items)
    try:
        return SplitConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def _print_join_hint(maddrs: Sequence[str]) -> None:
    shown = [m for m in maddrs if "/ip4/127." not in m] or list(maddrs)
    print("\nThis node's swarm is reachable at:", flush=True)
    for m in maddrs:
        print(f"  {m}", flush=True)
    print("Join it from another machine with:", flush=True)
    print(f"  dtrain-node --initial-peers {' '.join(shown)}\n", flush=True)


async def _serve(config: NodeConfig) -> None:
    from bridge.app import start_bridge
    from node.assets import ensure_tokenizer_files
    from node.corpus import load_corpus
    from node.data import TokenDataset
    from node.tokenizer import load_tokenizer
    from node.trainer import TrainingNode

    model_config = ModelConfig.load(config.model_config_path())
    train_config = TrainConfig.load(config.train_config_path())
    ensure_tokenizer_files(config.static_dir)
    tokenizer = load_tokenizer(config.static_dir)
    dataset = TokenDataset.from_text_file(config.train_data, tokenizer) if config.train_data else None
    # contributors get batches of the node's own text, else of the corpus set-up built: never trained on here, so
    # a node alone still makes one update per min_nodes_for_update contributors
    served = (dataset if dataset is not None else load_corpus(config.static_dir)) if config.serve_data else None

    node = TrainingNode(config, model_config, train_config, dataset)
    logger.info(f"Model {model_config.name}: {node.total_params:,} parameters; joining the swarm")
    node.start()  # on the main thread: hivemind's averagers install signal handlers

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = await start_bridge(node, config, tokenizer, served)
    _print_join_hint(node.maddrs)
    logger.info(f"Bridge listening on http://{config.host}:{config.port}/ (step {node.step})")
    watcher = asyncio.create_task(_stop_when_training_ends(node, stop))
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        logger.info("Shutting down")
        await runner.cleanup()
        await loop.run_in_executor(None, node.stop)
        logger.info("Stopped")


async def _stop_when_training_ends(node, stop: asyncio.Event) -> None:
    while node.is_alive():
        await asyncio.sleep(1.0)
    logger.error("The training thread ended; shutting the node down")
    stop.set()


def run(config: NodeConfig) -> None:
    asyncio.run(_serve(config))


def main(argv: Optional[Sequence[str]] = None) -> None:
    try:
        config = parse_config(argv)
    except (ConfigError, OSError, ValueError) as e:
        print(f"dtrain-node: {e}", file=sys.stderr)
        sys.exit(2)
    use_hivemind_log_handler("in_root_logger")
    logging.getLogger().setLevel(config.log_level.upper())
    try:
        run(config)
    except ConfigError as e:
        print(f"dtrain-node: {e}", file=sys.stderr)
        sys.exit(2)
    # The node has stopped: checkpoint written, swarm connection (and p2pd) shut down. Leave now rather than
    # wait on hivemind's background threads, which can hang interpreter exit after an update was cut short.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
