"""`dtrain-node`: the composition root. Parse flags into a NodeConfig, build the node's pieces (training node,
split service, tokenizer, dataset) and hand them to the bridge (`build`), then serve it until a signal (`run`). `node/` imports nothing of the bridge; the bridge
constructs no node service."""
from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from aiohttp import web
from hivemind.utils.logging import get_logger, use_hivemind_log_handler

from dtrain.bridge.app import create_app
from dtrain.flags import parse_config
from dtrain.node.children import die_with_this_process
from dtrain.node.checkpoint import CheckpointError
from dtrain.node.config import ConfigError, ModelConfig, NodeConfig, TrainConfig

if TYPE_CHECKING:
    from dtrain.node.serve.service import ServeService
    from dtrain.node.train.trainer import TrainingNode

logger = get_logger(__name__)


def _print_join_hint(maddrs: Sequence[str]) -> None:
    shown = [m for m in maddrs if "/ip4/127." not in m] or list(maddrs)
    print("\nThis node's swarm is reachable at:", flush=True)
    for m in maddrs:
        print(f"  {m}", flush=True)
    print("Join it from another machine with:", flush=True)
    print(f"  dtrain-node --initial-peers {' '.join(shown)}\n", flush=True)


@dataclass
class Built:
    """A node and its bridge app, built and joined to the swarm but not listening yet."""

    node: "TrainingNode"
    app: web.Application
    serve: "ServeService"

    def close(self) -> None:
        """Stop serving and training, then leave the swarm (the app's runner is its owner's to clean up first)."""
        self.serve.close()
        self.node.stop()


def build(config: NodeConfig) -> Built:
    """Build everything `dtrain-node` runs from a config: the training node (started: it joins the swarm, so call
    this on the main thread), the split and serving services, the tokenizer and the dataset, and the bridge's app.
    Nothing listens yet; the caller runs the app (`_serve` on `config.port`, tests on a port of their own)."""
    from dtrain.node import memory
    from dtrain.node.assets import tokenizer_files
    from dtrain.node.corpus import load_corpus
    from dtrain.node.data import TokenDataset
    from dtrain.node.device import use_threads
    from dtrain.node.frozen import SnapshotModels
    from dtrain.node.model import meta_template
    from dtrain.node.serve.service import for_node as serve_for_node
    from dtrain.node.split.service import for_node
    from dtrain.node.tokenizer import load_tokenizer
    from dtrain.node.train.trainer import TrainingNode

    memory.cap_mmap_threshold()  # freed tensors go back to the system (node.memory)
    threads = use_threads(config.torch_threads)  # before any thread runs a torch op (node.device)
    logger.info(f"torch uses {threads['intra_op']} threads per operation on the CPU, for training and serving alike")
    imported = None
    if config.init_from:
        from dtrain.node.hfdir import HFImportError, read as read_hf

        try:
            imported = read_hf(config.init_from)
        except HFImportError as e:
            raise ConfigError(f"--init-from: {e}") from None
        model_config = imported.config
        logger.info(f"Model from {config.init_from}: {model_config.architecture()}")
    else:
        model_config = ModelConfig.load(config.model_config_path())
    adapter = config.serve.feedback_lora
    if adapter is not None and adapter in (model_config.name, *(name for name, _ in config.split.experts)):
        raise ConfigError(f"--feedback-lora {adapter!r}: the shared model or a hosted --expert has that name already")
    train_config = TrainConfig.load(config.train_config_path())
    # the imported checkpoint's own tokenizer files when it has them, else the static dir's, else GPT-2's
    tokens = tokenizer_files(imported.tokenizer_dir if imported and imported.tokenizer_dir else config.static_dir)
    tokenizer = load_tokenizer(tokens)
    if tokenizer.get_vocab_size() > model_config.vocab_size:
        raise ConfigError(f"the tokenizer ({tokens.vocab}) has {tokenizer.get_vocab_size()} tokens and the model's "
                          f"vocab_size is {model_config.vocab_size}: its ids would not fit the embedding")
    dataset = TokenDataset.from_text_file(config.train_data, tokenizer) if config.train_data else None
    # contributors get batches of the node's own text, else of the packaged corpus: never trained on here, so
    # a node alone still makes one update per min_nodes_for_update contributors
    served = (dataset if dataset is not None else load_corpus()) if config.serve_data else None

    # the trusted reference is the node's own gradient on its own text: --train-data, else the packaged corpus
    own = dataset if dataset is not None else (served if served is not None else load_corpus())
    node = TrainingNode(config, model_config, train_config, dataset,
                        reference_data=own if config.reference_batch > 0 else None,
                        init_params=imported.params if imported is not None else None)
    logger.info(f"Model {model_config.name}: {node.total_params:,} parameters, computed on {node.device.describe()} "
                f"(the swarm's fp32 state on the CPU); joining the swarm")
    node.start()  # on the main thread: hivemind's averagers install signal handlers
    try:
        # one frozen model per published step for every engine that reads it (node.frozen)
        models = SnapshotModels.following(node, meta_template(model_config))
        split = for_node(node, config.split, tokenizer, models=models)
        # /v1 serves the shared model, and the hosted LoRA experts when they fit it (not a --split-model's)
        experts = split.experts if not config.split.split_model else None
        serve = serve_for_node(node, config.serve, tokenizer, experts=experts, models=models)
    except BaseException:
        node.stop()
        raise
    app = create_app(node, config, split=split, tokenizer=tokenizer, dataset=served, serve=serve,
                     tokenizer_files=tokens)
    return Built(node=node, app=app, serve=serve)


async def _serve(config: NodeConfig) -> None:
    built = build(config)
    node = built.node
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(built.app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    _print_join_hint(node.maddrs)
    logger.info(f"Bridge listening on http://{config.host}:{config.port}/ (step {node.step})")
    watcher = asyncio.create_task(_stop_when_training_ends(node, stop))
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        logger.info("Shutting down")
        await runner.cleanup()
        await loop.run_in_executor(None, built.serve.close)
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
    # `kill -USR1 <pid>` writes every thread's stack to stderr and the node goes on: how a node that hangs is read
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT) leaves every thread's stack in the log
    die_with_this_process()  # hivemind's DHT and averager processes (forked next) never outlive the node
    logging.getLogger().setLevel(config.log_level.upper())
    try:
        run(config)
    except (ConfigError, CheckpointError) as e:  # a checkpoint that does not fit: refused whole, say why
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
