"""Training API v1 routes: model info and download, DGRD submissions, losses, data batches."""
from __future__ import annotations

import asyncio
import dataclasses
import json

from aiohttp import web

from dtrain.bridge import dgrd
from dtrain.bridge.bodybuf import Body, body_buffer
from dtrain.bridge.http import ApiError, RetryLater, int_param, read_body
from dtrain.bridge.gate import GateError
from dtrain.bridge.keys import DATASET, GATE, LEDGER, NODE, STATE
from dtrain.node.config import ModelConfig
from dtrain.node.contribution import Contribution
from dtrain.node.train.ledger import ContributorLedger, RejectReason
from dtrain.node.model import TensorInfo
from dtrain.node.train.pool import PoolFull, StepMismatch
from dtrain.node.train.status import NodeStatus

FORMATS = ("f16", "f32")
MAX_BATCH_SIZE = 256  # sequences per /api/v1/data/batch answer
SEND_CHUNK_BYTES = 1 << 20  # writes of a download when sendfile is not available: bounded transport buffer
POOL_FULL_RETRY_S = 1  # Retry-After of a 503: the training thread takes what the pool holds between updates
# A packet up to this size is decoded and handed over on the event loop, larger ones on the executor. The hop to a
# worker thread and back is two cross-thread wake-ups, about 0.7 ms per post on this VM (py-spy, GPT-2-small node),
# twice the decode of the browser's 4 MB Mode 2 packet (0.35 ms). The bound keeps the loop's longest hold short:
# decode's slowest rate is about 3.5 MB/ms (dense float16, numpy), so about 1.2 ms.
INLINE_INGEST_BYTES = 4 << 20


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


# ---- the node's typed records as the API spells them ---------------------------------------------------

def model_config_block(config: ModelConfig) -> dict:
    """The `config` block of `/api/v1/model/info`."""
    keys = ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len")
    return {k: getattr(config, k) for k in keys}


def manifest_entry(t: TensorInfo) -> dict:
    return {"id": t.id, "name": t.name, "shape": list(t.shape), "elements": t.elements,
            "bytes_f32": t.elements * 4, "bytes_f16": t.elements * 2}


def status_json(s: NodeStatus) -> dict:
    body = dataclasses.asdict(s)
    body["maddrs"] = list(s.maddrs)
    body["samples_total"] = s.accepted_samples  # the dashboard's name for it
    body["nodes"] = [{"peer_id": n.peer_id, "step": n.step, "bridge_port": n.bridge_port, "maddrs": list(n.maddrs),
                      "training": n.training, "pending_samples": n.pending_samples, "time": n.time} for n in s.nodes]
    return body


def contribution(packet: dgrd.Packet) -> Contribution:
    """The node's input: a decoded, fully validated packet (its sections are the node's, views of the packet)."""
    return Contribution(contributor=packet.node_id, step=packet.step, samples=packet.samples,
                        loss=packet.train_loss, sections=packet.sections)


# ---- routes ---------------------------------------------------------------------------------------------

async def model_info(request: web.Request) -> web.Response:
    node = request.app[NODE]
    snap = node.snapshot()
    return web.json_response({
        "step": snap.step,
        "updates": snap.updates,
        "total_params": node.total_params,
        "config": model_config_block(node.model_config),
        "train": {**dataclasses.asdict(node.train_config),
                  "max_samples_per_packet": request.app[GATE].config.max_samples_per_packet},
    })


async def manifest(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response({
        "step": node.step,
        "tensors": [manifest_entry(t) for t in node.tensors],
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
    headers = {
        "X-Model-Step": str(snap.step),
        "X-Tensor-Id": str(tensor_id),
        "X-Tensor-Offset": str(offset),
        "X-Tensor-Count": str(count),
        "X-Tensor-Format": fmt,
    }
    if fmt == "f16":
        source, fobj, start = snap.f16[tensor_id], snap.f16_file, snap.f16_offsets[tensor_id] if snap.f16_offsets else 0
    else:
        source, fobj, start = snap.f32[tensor_id], snap.f32_file, snap.f32_offsets[tensor_id] if snap.f32_offsets else 0
    body = memoryview(source[offset:offset + count]).cast("B")  # a view: no copy of the tensor
    if fobj is None or not body.nbytes:
        return web.Response(body=body, content_type="application/octet-stream", headers=headers)
    return await _send_range(request, headers, fobj, start + offset * source.itemsize, body)


async def _send_range(request: web.Request, headers: dict, fobj, offset_bytes: int, body: memoryview):
    """Answer with bytes [offset_bytes, offset_bytes + body.nbytes) of the snapshot's file, sent by the kernel.

    Measured on GPT-2 small, a Response(body=view) reached half the speed of aiohttp's static files: asyncio copies
    whatever the socket does not take at once into the transport's buffer. sendfile() sends from the page cache as
    FileResponse does. `body` is the same bytes as a view, written when sendfile is not available (TLS).
    """
    response = web.StreamResponse(headers=headers)
    response.content_type = "application/octet-stream"
    response.content_length = body.nbytes
    writer = await response.prepare(request)  # StreamResponse sends its headers here, before the kernel's bytes
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("connection lost")
    try:
        # explicit offsets: concurrent downloads share fobj without seeking it (fallback=False: the fallback would)
        await asyncio.get_running_loop().sendfile(transport, fobj, offset_bytes, body.nbytes, fallback=False)
    except asyncio.SendfileNotAvailableError:  # raised before any byte is sent
        for start in range(0, body.nbytes, SEND_CHUNK_BYTES):
            await writer.write(body[start:start + SEND_CHUNK_BYTES])
    await response.write_eof()
    return response


async def where_ingested(nbytes: int, fn, *args):
    """`fn(*args)` for a packet of `nbytes`: on the event loop up to INLINE_INGEST_BYTES, on the executor above."""
    if nbytes <= INLINE_INGEST_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _ingest(node, body: Body, state, gate, ledger: ContributorLedger) -> int:
    """Decode and validate the whole packet, check it at the gate, hand it to the node (where `where_ingested`
    runs it)."""
    try:
        packet = dgrd.decode(body, state.tensor_elements)  # reductions over the body: nothing per entry allocated
    except dgrd.PacketError as e:
        raise ApiError(400, f"malformed packet: {e}", server_step=node.step) from None
    try:
        gate.check_packet(packet.node_id, packet.samples, server_step=node.step)  # 400 above the cap, 429
    except GateError as e:
        if e.reason is not None:
            ledger.rejected(packet.node_id, e.reason)
        raise
    refusal = ledger.refusal(packet.node_id)  # scored out for its record (node/train/ledger.py)
    if refusal is not None:
        ledger.rejected(packet.node_id, RejectReason.SCORED_OUT)
        raise ApiError(403, refusal, server_step=node.step)
    try:
        step = node.submit(contribution(packet))
    except StepMismatch as e:
        ledger.rejected(packet.node_id, RejectReason.STEP_MISMATCH)
        raise ApiError(409, "step mismatch; fetch latest model", server_step=e.server_step) from None
    except PoolFull as e:
        ledger.rejected(packet.node_id, RejectReason.NODE_BUSY)
        raise RetryLater(503, f"node busy: {e}", POOL_FULL_RETRY_S, server_step=node.step) from None
    ledger.accepted(packet.node_id, packet.samples)
    return step


async def submit(request: web.Request) -> web.Response:
    node, state, gate = request.app[NODE], request.app[STATE], request.app[GATE]
    gate.authorize(request.headers)  # 401 before the body is read: nothing applied
    gate.check_address(request.remote)
    body = await read_body(request, state.max_packet_bytes, body_buffer)  # huge pages: no fault per 4 KiB
    step = await where_ingested(len(body), _ingest, node, body, state, gate, request.app[LEDGER])
    return web.json_response({"ok": True, "message": "ok", "server_step": step})


async def contributors(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    limit = int_param(request, "limit", 100, minimum=1)
    return web.json_response({"summary": dataclasses.asdict(ledger.summary()),
                              "contributors": [dataclasses.asdict(r) for r in ledger.records(limit)]})


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
    return web.json_response(status_json(request.app[NODE].status()))


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
    app.router.add_get("/api/v1/contributors", contributors)
    app.router.add_get("/static/model_config.json", config_file("model"))
    app.router.add_get("/static/train_config.json", config_file("train"))
