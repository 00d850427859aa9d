"""The bridge's app factory: Training API v1, split inference, the OpenAI-compatible /v1 API and the static pages
in front of one node.

The composition root (`dtrain.cli`) builds the node's pieces and hands them in; the bridge builds none.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from aiohttp import web
from hivemind.utils.logging import get_logger

from dtrain.bridge import dgrd, http, metrics, openai_routes, openapi, split_routes, training_routes
from dtrain.bridge.http import ApiError
from dtrain.bridge.gate import Gate, GateConfig
from dtrain.bridge.keys import CONFIG, DATASET, GATE, LEDGER, NODE, STATE, TOKENIZER, BridgeState
from dtrain.node import assets
from dtrain.node.config import NodeConfig
from dtrain.node.data import TokenDataset
from dtrain.node.serve.service import ServeService
from dtrain.node.split.service import SplitService
from dtrain.node.train.trainer import TrainingNode

logger = get_logger(__name__)


def create_app(node: TrainingNode, config: NodeConfig, split: Optional[SplitService] = None, tokenizer=None,
               dataset: Optional[TokenDataset] = None, serve: Optional[ServeService] = None,
               tokenizer_files: Optional[assets.TokenizerFiles] = None) -> web.Application:
    tensor_elements = tuple(t.elements for t in node.tensors)
    max_packet = dgrd.max_packet_bytes(tensor_elements)
    app = web.Application(client_max_size=max_packet + 1024)
    app[NODE], app[CONFIG], app[DATASET], app[TOKENIZER] = node, config, dataset, tokenizer
    app[STATE] = BridgeState(tensor_elements=tensor_elements, max_packet_bytes=max_packet)
    app[GATE] = Gate(GateConfig(max_samples_per_packet=config.max_samples_per_packet,
                                rate_per_s=config.rate_limit_per_s, burst=config.rate_burst,
                                contributor_tokens=config.contributor_tokens))
    app[LEDGER] = node.ledger  # the bridge counts what it refuses; the node what its aggregation found
    http.install(app)
    training_routes.add_routes(app)
    if split is not None:
        split_routes.add_routes(app, split)
    if serve is not None:
        openai_routes.add_routes(app, serve)
    metrics.setup(app, node, app.get(split_routes.SPLIT), app.get(openai_routes.SERVE))
    openapi.setup(app)
    static_dir = Path(config.static_dir)
    _add_pages(app, static_dir, (tokenizer_files or assets.tokenizer_files(static_dir)).by_name)
    if not (static_dir / "vendor" / "tf.js").exists():
        logger.warning(f"{static_dir / 'vendor'} has no browser bundle (tf.js): pages load, but browsers cannot "
                       f"train. Build it in the source tree with `make setup` (npm ci && npm run build), then "
                       f"install again")
    return app


# Pages and static files are served cross-origin isolated: browsers give SharedArrayBuffer, which TensorFlow.js's
# threaded WASM SIMD build needs, only to an isolated page and to workers whose own script also carries COEP.
# Everything the pages load comes from this node (no CDN), so require-corp blocks nothing; other origins still
# reach the API with CORS, which COEP allows.
ISOLATION_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp"}


def _add_pages(app: web.Application, static_dir: Path, files: dict[str, Path]) -> None:
    """The pages, and /static/: the static directory's files plus `files` (the tokenizer's, kept elsewhere)."""
    pages = {"/": "index.html", "/contribute": "contribute.html", "/chat": "chat.html"}
    for route, name in pages.items():
        if (static_dir / name).exists():
            app.router.add_get(route, _file_handler(static_dir / name))
    app.router.add_get("/static/{name:.+}", _static_handler(static_dir, files))


def _static_handler(static_dir: Path, files: dict[str, Path]):
    # Not app.router.add_static: for a missing file its FileResponse answers 404 with no body and no
    # Content-Length, i.e. chunked, which the spec forbids; here a missing file is a JSON 404 like any other.
    root = static_dir.resolve()

    async def handler(request: web.Request) -> web.FileResponse:
        name = request.match_info["name"]
        if name in files:
            return web.FileResponse(files[name], headers=ISOLATION_HEADERS)
        path = (root / name).resolve()  # symlinks resolved: nothing outside static_dir is served
        if root not in path.parents or not path.is_file():
            raise ApiError(404, f"no static file {name!r}")
        return web.FileResponse(path, headers=ISOLATION_HEADERS)
    return handler


def _file_handler(path: Path):
    async def handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(path, headers=ISOLATION_HEADERS)
    return handler
