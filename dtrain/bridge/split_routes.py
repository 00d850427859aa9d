"""Split inference over WebSocket (`/api/v1/split/stream`) and HTTP (`/api/v1/split/*`).

The handlers parse and validate the JSON messages of the split protocol, hand typed arrays to the
node's SplitService on a worker thread (so sessions run side by side and the event loop stays free),
and turn the node's typed errors into `{"type": "error", "message": ...}` on the socket or a 400 JSON
answer over HTTP. A bad message never closes the socket.

Frame sizes. `limit` = SplitService.frame_limit_bytes (enough for max_seq_len positions by default):
- a message up to `limit` is parsed;
- a message in (limit, 2 * limit] is answered with an error, and the socket stays open;
- aiohttp itself refuses a message over `2 * limit` (`max_msg_size`): it closes the socket with code
  1009 (MESSAGE_TOO_BIG) before any handler sees the data, so no error message can be sent.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web
from hivemind.utils.logging import get_logger

from dtrain.bridge.http import ApiError, read_body
from dtrain.node.split.engine import ForwardResult
from dtrain.node.split.kv_cache import SplitError
from dtrain.node.split.service import HE_POLY_MODULUS_DEGREE, SplitService

logger = get_logger(__name__)

SEND_TIMEOUT_S = 30.0  # bound on writing one answer to a slow client
HEARTBEAT_S = 30.0  # aiohttp pings the client this often and drops it when the pong does not come
TOKENIZE_MAX_CHARS = 1_000_000  # longest text one `tokenize` accepts


class RequestError(ValueError):
    """A split request is malformed; the message says which field and why."""


def error_code(e: Exception) -> str:
    """A stable machine-readable name for an error: StaleSessionError -> "stale_session"."""
    name = type(e).__name__.removesuffix("Error") or "error"
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)  # HEUnavailable -> HE_Unavailable
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def error_message(e: Exception) -> dict:
    return {"type": "error", "message": str(e), "code": error_code(e)}


class SplitApiError(ApiError):
    """A 400 answer that also carries the error's code (clients restart stale sessions on it)."""

    def __init__(self, cause: Exception):
        super().__init__(400, str(cause))
        self.code = error_code(cause)

    def response(self) -> web.Response:
        return web.json_response({"ok": False, "message": self.message, "code": self.code}, status=self.status)


@dataclass
class SplitState:
    service: SplitService
    executor: Optional[ThreadPoolExecutor] = None  # forward calls run here (created on startup)
    sockets: set = field(default_factory=set)  # open WebSocketResponses, closed on shutdown
    forward_listeners: list = field(default_factory=list)  # called with the seconds of each WebSocket forward


SPLIT = web.AppKey("split", SplitState)


@dataclass(frozen=True)
class ForwardRequest:
    hidden: np.ndarray  # float32 [seq_len, hidden_dim]
    session_id: Optional[str]
    incremental: bool
    expert_name: Optional[str]
    use_he: bool


def config_message(service: SplitService) -> dict:
    """The protocol's `config` message: the service's facts, and the URLs this bridge serves them at."""
    facts, dp = service.facts, service.config.dp
    if facts.embedding_tensor_id is not None:
        embedding_url = f"/api/v1/model/tensor/{facts.embedding_tensor_id}"
    else:
        embedding_url = "/api/v1/split/embedding"
    return {
        "type": "config",
        "model": facts.name,
        "hidden_size": facts.hidden_size,
        "vocab_size": facts.vocab_size,
        "max_seq_len": facts.max_seq_len,
        "embedding_tensor_id": facts.embedding_tensor_id,
        "embedding_url": embedding_url,  # add ?format=f16 or f32
        "tied_lm_head": facts.tied_lm_head,
        "eos_token_id": facts.eos_token_id,
        "lm_head_url": embedding_url if facts.tied_lm_head else "/api/v1/split/lm_head",
        "experts": service.expert_names(),
        "he": {
            "available": service.he_available,
            "scheme": "CKKS",
            "poly_modulus_degree": HE_POLY_MODULUS_DEGREE if service.he_available else None,
            # the node holds the secret key: CKKS protects LoRA intermediates, not data from the node
            "protects": "LoRA intermediates in memory and between HE workers",
        },
        "dp": {"epsilon": dp.epsilon, "delta": dp.delta, "clip": dp.clip, "sigma": dp.sigma},
        "max_frame_bytes": service.frame_limit_bytes,
        "step": service.step,
    }


# ---- parsing (no I/O) -----------------------------------------------------------------------------------


def _int_field(payload: dict, name: str) -> int:
    value = payload.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    return value


def _bool_field(payload: dict, name: str) -> bool:
    value = payload.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}")
    return value


def parse_forward(payload: dict, service: SplitService) -> ForwardRequest:
    """Validate a `forward` message against the served model; raises RequestError naming the problem."""
    facts = service.facts
    seq_len = _int_field(payload, "seq_len")
    hidden_dim = _int_field(payload, "hidden_dim")
    if hidden_dim != facts.hidden_size:
        raise RequestError(f"hidden_dim {hidden_dim} does not match the model's hidden size {facts.hidden_size}")
    if not 1 <= seq_len <= facts.max_seq_len:
        raise RequestError(f"seq_len must be in [1, {facts.max_seq_len}] (the model's positions), got {seq_len}")
    encoded = payload.get("hidden_states")
    if not isinstance(encoded, str):
        raise RequestError("hidden_states must be a base64 string of little-endian float32 [seq_len, hidden_dim]")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"hidden_states is not valid base64 ({e})") from None
    want = seq_len * hidden_dim * 4
    if len(raw) != want:
        raise RequestError(
            f"hidden_states has {len(raw)} bytes; seq_len {seq_len} x hidden_dim {hidden_dim} float32 needs {want}"
        )
    hidden = np.frombuffer(raw, dtype="<f4", count=seq_len * hidden_dim).reshape(seq_len, hidden_dim)
    hidden = hidden.astype(np.float32)  # native order, writable copy
    expert_name = payload.get("expert_name")
    if expert_name is not None and not isinstance(expert_name, str):
        raise RequestError(f"expert_name must be a string or null, got {expert_name!r}")
    if expert_name and expert_name not in service.experts:
        raise RequestError(f"this node hosts no expert {expert_name!r}; hosted experts: {service.expert_names()}")
    session_id = payload.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        raise RequestError(f"session_id must be a string or null, got {session_id!r}")
    return ForwardRequest(
        hidden=hidden,
        session_id=session_id or None,
        incremental=_bool_field(payload, "incremental"),
        expert_name=expert_name or None,
        use_he=_bool_field(payload, "use_he"),
    )


def forward_answer(result: ForwardResult, request: ForwardRequest) -> dict:
    return {
        "type": "forward",
        "pre_activations": base64.b64encode(result.pre_activations.astype("<f4", copy=False).tobytes()).decode("ascii"),
        "seq_len": int(result.pre_activations.shape[0]),
        "hidden_dim": int(result.pre_activations.shape[1]),
        "he_active": result.he_active,
        "encrypt_ms": round(result.encrypt_ms, 3),
        "compute_ms": round(result.compute_ms, 3),
        "decrypt_ms": round(result.decrypt_ms, 3),
        "total_ms": round(result.total_ms, 3),
        "dp_sigma": result.dp_sigma,
        "incremental": result.incremental,
        "cached_seq_len": result.cached_seq_len,
        "session_id": request.session_id,
        "step": result.step,
    }


def parse_json(data: str | bytes) -> dict:
    try:
        payload = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"message is not valid JSON ({e})") from None
    if not isinstance(payload, dict):
        raise RequestError(f"message must be a JSON object, got {type(payload).__name__}")
    return payload


# ---- the protocol's messages, shared by WebSocket and HTTP ---------------------------------------------


async def _in_worker(state: SplitState, fn, *args, timeout_s: float):
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(state.executor, fn, *args), timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(f"the node did not answer within {timeout_s:.0f} s; try again") from None


async def handle_message(state: SplitState, payload: dict, default_type: Optional[str] = None) -> dict:
    """The answer to one protocol message; raises RequestError or SplitError for a bad request."""
    service = state.service
    kind = payload.get("type", default_type)
    if kind == "ping":
        return {"type": "pong"}
    if kind == "config":
        return config_message(service)
    if kind == "tokenize":
        text = payload.get("text")
        if not isinstance(text, str):
            raise RequestError("tokenize needs text: a string")
        if len(text) > TOKENIZE_MAX_CHARS:
            raise RequestError(f"text of {len(text)} characters exceeds {TOKENIZE_MAX_CHARS}")
        ids = await _in_worker(state, service.tokenize, text, timeout_s=service.config.forward_timeout_s)
        return {"type": "tokenize", "token_ids": ids, "length": len(ids)}
    if kind == "forward":
        request = parse_forward(payload, service)
        result = await _in_worker(
            state, service.forward, request.hidden, request.session_id, request.incremental,
            request.expert_name, request.use_he, timeout_s=service.config.forward_timeout_s,
        )
        return forward_answer(result, request)
    raise RequestError(f"unknown message type {kind!r}; expected ping, config, tokenize or forward")


# ---- WebSocket -------------------------------------------------------------------------------------------


async def stream(request: web.Request) -> web.WebSocketResponse:
    state = request.app[SPLIT]
    limit = state.service.frame_limit_bytes
    ws = web.WebSocketResponse(max_msg_size=2 * limit, heartbeat=HEARTBEAT_S)
    await ws.prepare(request)
    state.sockets.add(ws)
    try:
        while not ws.closed:
            # an idle client outlives its session cache by nothing: drop it after the session TTL
            try:
                msg = await ws.receive(timeout=state.service.config.session_ttl_s)
            except asyncio.TimeoutError:
                await ws.close(code=WSCloseCode.GOING_AWAY, message=b"idle")
                break
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                break
            if msg.type == WSMsgType.ERROR:
                # aiohttp already closed the socket (for an oversize frame with code 1009)
                logger.info("split socket closed by aiohttp: %s", ws.exception())
                break
            started = time.perf_counter()
            answer = await _answer(state, msg, limit)
            await asyncio.wait_for(ws.send_json(answer), SEND_TIMEOUT_S)
            if answer.get("type") == "forward":  # answered, not an error: request to sent answer
                for listener in state.forward_listeners:
                    listener(time.perf_counter() - started)
    except (ConnectionResetError, asyncio.TimeoutError) as e:
        logger.info("split socket dropped: %r", e)
    finally:
        state.sockets.discard(ws)
    return ws


async def _answer(state: SplitState, msg, limit: int) -> dict:
    payload: dict = {}
    try:
        if msg.type != WSMsgType.TEXT:
            raise RequestError("send JSON text frames (binary frames are not part of the protocol)")
        if len(msg.data) > limit:
            raise RequestError(f"message of {len(msg.data)} characters exceeds the node's limit of {limit} bytes")
        payload = parse_json(msg.data)
        answer = await handle_message(state, payload)
    except (RequestError, SplitError) as e:  # the request's fault: answered, the socket stays open
        answer = error_message(e)
    except Exception as e:  # a bug of ours: log it, keep the socket
        logger.exception("split message failed: %s", e)
        answer = {"type": "error", "message": "internal error", "code": "internal"}
    if "id" in payload:  # optional request id, echoed so clients may match answers
        answer["id"] = payload["id"]
    return answer


# ---- HTTP ------------------------------------------------------------------------------------------------


async def _http(request: web.Request, kind: str) -> web.Response:
    state = request.app[SPLIT]
    body = await read_body(request, state.service.frame_limit_bytes)
    try:
        payload = parse_json(body)
        if payload.get("type", kind) != kind:
            raise RequestError(f"this route takes {kind!r} messages, got type {payload.get('type')!r}")
        answer = await handle_message(state, payload, default_type=kind)
    except (RequestError, SplitError) as e:
        raise SplitApiError(e) from None
    return web.json_response(answer)


async def http_forward(request: web.Request) -> web.Response:
    return await _http(request, "forward")


async def http_tokenize(request: web.Request) -> web.Response:
    return await _http(request, "tokenize")


async def http_config(request: web.Request) -> web.Response:
    return web.json_response(config_message(request.app[SPLIT].service))


def _matrix_handler(which: str):
    async def handler(request: web.Request) -> web.Response:
        service = request.app[SPLIT].service
        matrix = service.local_matrix(which)
        if matrix is None:
            hint = (f"download /api/v1/model/tensor/{service.facts.embedding_tensor_id}"
                    if service.facts.embedding_tensor_id is not None else "the LM head is tied: use /api/v1/split/embedding")
            raise ApiError(404, f"this node serves no separate {which} matrix; {hint}")
        fmt = request.query.get("format", "f16")
        if fmt not in ("f16", "f32"):
            raise ApiError(400, f"format must be f16 or f32, got {fmt!r}")
        array = matrix.numpy().astype("<f2" if fmt == "f16" else "<f4")
        return web.Response(body=array.tobytes(), content_type="application/octet-stream", headers={
            "X-Model-Step": str(service.step), "X-Tensor-Format": fmt,
            "X-Tensor-Count": str(array.size),
        })
    return handler


# ---- wiring ----------------------------------------------------------------------------------------------


async def _executor_ctx(app: web.Application):
    state = app[SPLIT]
    state.executor = ThreadPoolExecutor(max_workers=state.service.config.workers, thread_name_prefix="split")
    yield
    state.executor.shutdown(wait=False, cancel_futures=True)


async def _close_sockets(app: web.Application) -> None:
    for ws in list(app[SPLIT].sockets):
        try:
            await asyncio.wait_for(ws.close(code=WSCloseCode.GOING_AWAY, message=b"node shutting down"), 5.0)
        except Exception as e:  # a dead peer must not stop the shutdown
            logger.info("closing a split socket failed: %r", e)


def add_routes(app: web.Application, service: SplitService) -> None:
    app[SPLIT] = SplitState(service=service)
    app.cleanup_ctx.append(_executor_ctx)
    app.on_shutdown.append(_close_sockets)
    app.router.add_get("/api/v1/split/stream", stream)
    app.router.add_get("/api/v1/split/config", http_config)
    app.router.add_post("/api/v1/split/forward", http_forward)
    app.router.add_post("/api/v1/split/tokenize", http_tokenize)
    app.router.add_get("/api/v1/split/embedding", _matrix_handler("embedding"))
    app.router.add_get("/api/v1/split/lm_head", _matrix_handler("lm_head"))
