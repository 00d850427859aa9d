"""Training API v1 routes: model info and download, DGRD submissions, losses, data batches."""
from __future__ import annotations

import asyncio
import dataclasses
import json

from aiohttp import web

from bridge import dgrd
from bridge.http import ApiError, int_param, read_body
from bridge.keys import DATASET, NODE, STATE
from node.trainer import StepMismatch

FORMATS = ("f16", "f32")
MAX_BATCH_SIZE = 256  # sequences per /api/v1/data/batch answer


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def model_info(request: web.Request) -> web.Response:
    node = request.app[NODE]
    snap = node.snapshot()
    return web.json_response({
        "step": snap.step,
        "updates": snap.updates,
        "total_params": node.total_params,
        "config": node.model_config.api_dict(),
        "train": node.train_config.api_dict(),
    })


async def manifest(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response({
        "step": node.step,
        "tensors": [t.manifest_entry() for t in node.tensors],
    })


async def tensor(request: web.Request) -> web.Response:
    node = request.app[NODE]
    raw_id = request.match_info["id"]
    try:
        tensor_id = int(raw_id)
    except ValueError:
        raise ApiError(400, f"tensor id must be an integer, got {raw_id!r}") from None
    fmt = request.query.get("format", "f16")
    if fmt not in FORMATS:
        raise ApiError(400, f"format must be f16 or f32, got {fmt!r}")
    offset = int_param(request, "offset", 0)
    count = int_param(request, "count", None)
    if not 0 <= tensor_id < len(node.tensors):
        raise ApiError(404, f"no tensor {tensor_id}; the manifest has ids 0..{len(node.tensors) - 1}")
    elements = node.tensors[tensor_id].elements
    if count is None:
        count = max(elements - offset, 0)
    if offset > elements or offset + count > elements:
        raise ApiError(416, f"offset {offset} + count {count} is past the tensor's {elements} elements")

    snap = node.snapshot()  # one snapshot: every byte below is from snap.step
    source = snap.f16 if fmt == "f16" else snap.f32
    body = memoryview(source[tensor_id][offset:offset + count]).cast("B")  # a view: no copy of the tensor
    return web.Response(body=body, content_type="application/octet-stream", headers={
        "X-Model-Step": str(snap.step),
        "X-Tensor-Id": str(tensor_id),
        "X-Tensor-Offset": str(offset),
        "X-Tensor-Count": str(count),
        "X-Tensor-Format": fmt,
    })


def _ingest(node, body: bytes, tensor_elements) -> int:
    """Decode and validate the whole packet, then apply it; runs off the event loop."""
    try:
        packet = dgrd.decode(body, tensor_elements)
    except dgrd.PacketError as e:
        raise ApiError(400, f"malformed packet: {e}", server_step=node.step) from None
    try:
        return node.submit(
            node_id=packet.node_id,
            packet_step=packet.step,
            samples=packet.samples,
            train_loss=packet.train_loss,
            scatter=lambda sums, weight: dgrd.accumulate(packet, sums, weight),
        )
    except StepMismatch as e:
        raise ApiError(409, "step mismatch; fetch latest model", server_step=e.server_step) from None


async def submit(request: web.Request) -> web.Response:
    node, state = request.app[NODE], request.app[STATE]
    body = await read_body(request, state.max_packet_bytes)
    loop = asyncio.get_running_loop()
    step = await loop.run_in_executor(None, _ingest, node, body, state.tensor_elements)
    return web.json_response({"ok": True, "message": "ok", "server_step": step})


async def losses(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].losses())


async def data_batch(request: web.Request) -> web.Response:
    """Token batches for contributors without data: little-endian u32, shape in X-Batch-Size/X-Seq-Len."""
    dataset, node = request.app[DATASET], request.app[NODE]
    if dataset is None:
        raise ApiError(404, "this node hands out no data (started with --no-data, or set-up built no default corpus);"
                            " bring your own text, or start it with --train-data FILE")
    batch_size = int_param(request, "batch_size", 8, minimum=1)
    seq_len = int_param(request, "seq_len", min(64, node.model_config.max_seq_len), minimum=2)
    if batch_size > MAX_BATCH_SIZE:
        raise ApiError(400, f"batch_size must be <= {MAX_BATCH_SIZE}, got {batch_size}")
    if seq_len > node.model_config.max_seq_len:
        raise ApiError(400, f"seq_len must be <= max_seq_len {node.model_config.max_seq_len}, got {seq_len}")
    if seq_len > len(dataset):
        raise ApiError(400, f"seq_len {seq_len} is longer than the dataset ({len(dataset)} tokens)")
    batch = dataset.batch(batch_size, seq_len, request.app[STATE].rng).astype("<u4")
    return web.Response(body=batch.tobytes(), content_type="application/octet-stream", headers={
        "X-Batch-Size": str(batch_size),
        "X-Seq-Len": str(seq_len),
        "X-Model-Step": str(node.step),
    })


async def swarm_status(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].status())


def config_file(name: str):
    """Serve the config the node actually loaded, as JSON (NOTES.md: also when it came from a flag)."""
    async def handler(request: web.Request) -> web.Response:
        node = request.app[NODE]
        data = node.model_config if name == "model" else node.train_config
        return web.Response(text=json.dumps(dataclasses.asdict(data), indent=2), content_type="application/json")
    return handler


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/v1/model/info", model_info)
    app.router.add_get("/api/v1/model/manifest", manifest)
    app.router.add_get("/api/v1/model/tensor/{id}", tensor)
    app.router.add_post("/api/v1/train/submit", submit)
    app.router.add_get("/api/v1/server/losses", losses)
    app.router.add_get("/api/v1/data/batch", data_batch)
    app.router.add_get("/api/v1/swarm/status", swarm_status)
    app.router.add_get("/static/model_config.json", config_file("model"))
    app.router.add_get("/static/train_config.json", config_file("train"))
