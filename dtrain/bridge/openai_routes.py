"""The OpenAI-compatible API of a node: /v1/completions, /v1/chat/completions (streamed as server-sent events with
`stream: true`), /v1/models, and /v1/feedback for the rewards of what was served.

Handlers parse the body (bridge.openai_api), hand the typed request to the node's ServeService on a worker thread
(tokenizing is not the event loop's work), and wait on the ticket's events, which the engine thread passes to
this loop with `call_soon_threadsafe`. Every answer reports the model step that wrote it (`dtrain_step`, and
`system_fingerprint` = "dtrain-step-N"). Errors have OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`: 400 for a bad request, 404 for an unknown model or completion id, 429 past the queue.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from aiohttp import web
from hivemind.utils.logging import get_logger

from dtrain.bridge.http import ApiError, read_body
from dtrain.bridge.openai_api import (OpenAIRequestError, chat_logprobs, completion_logprobs, error_body, fingerprint,
                               parse_chat, parse_completion, parse_feedback, usage)
from dtrain.node.serve.capture import CaptureError, FeedbackForbidden
from dtrain.node.serve.engine import Delta, Done, Event, Failed, Finish, QueueFullError, ServeError, TokenLogprob
from dtrain.node.serve.service import CHAT, CaptureOffError, ContextLengthError, Prepared, ServeService, UnknownModelError

logger = get_logger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
WORKERS = 2  # threads that tokenize prompts and write capture records


class OpenAIError(ApiError):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(status, message)
        self.kind, self.param, self.code = kind, param, code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def _bad(e: OpenAIRequestError) -> OpenAIError:
    return OpenAIError(400, str(e), param=e.param, code=e.code)


def _from_node(e: Exception) -> OpenAIError:
    if isinstance(e, UnknownModelError):
        return OpenAIError(404, str(e), param="model", code="model_not_found")
    if isinstance(e, ContextLengthError):
        return OpenAIError(400, str(e), param=e.param, code="context_length_exceeded")
    if isinstance(e, QueueFullError):
        return OpenAIError(429, str(e), kind="rate_limit_error", code="queue_full")
    return OpenAIError(500, f"the node could not serve this request: {e}", kind="server_error")


@dataclass
class ServeState:
    service: ServeService
    executor: Optional[ThreadPoolExecutor] = None


SERVE = web.AppKey("serve", ServeState)


async def _json_body(request: web.Request, state: ServeState):
    body = await read_body(request, state.service.config.max_body_bytes)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON ({e})") from None


async def _in_worker(state: ServeState, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(state.executor, fn, *args)


# ---- completions and chat

class _Run:
    """One submitted request: its ticket and the events the engine thread handed to this loop."""

    def __init__(self, state: ServeState, prepared: Prepared):
        self.state, self.prepared = state, prepared
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            self.ticket = state.service.submit(prepared, lambda e: loop.call_soon_threadsafe(self.events.put_nowait, e))
        except ServeError as e:
            raise _from_node(e) from None
        self.deadline = loop.time() + state.service.config.request_timeout_s

    async def next(self) -> Event:
        remaining = self.deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(self.events.get(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            self.ticket.cancel()
            return Failed(f"the completion did not finish within the node's {self.state.service.config.request_timeout_s:.0f} s")

    async def record(self) -> None:
        try:
            await _in_worker(self.state, self.state.service.record, self.prepared, self.ticket)
        except Exception as e:  # the answer was served: a capture failure is logged, not the client's problem
            logger.exception(f"recording {self.prepared.id} failed: {e!r}")


async def _start(request: web.Request, chat: bool):
    state = request.app[SERVE]
    body = await _json_body(request, state)
    service = state.service
    try:
        if chat:
            parsed, stream, include_usage = parse_chat(body, service.config)
        else:
            parsed, stream, include_usage = parse_completion(body, service.config, service.vocab_size)
    except OpenAIRequestError as e:
        raise _bad(e) from None
    try:
        prepared = await _in_worker(state, service.prepare, parsed)
    except ServeError as e:
        raise _from_node(e) from None
    return state, prepared, stream, include_usage


def _head(prepared: Prepared, step: int, obj: str) -> dict:
    head = {"id": prepared.id, "object": obj, "created": prepared.created, "model": prepared.request.model,
            "system_fingerprint": fingerprint(step), "dtrain_step": step}
    if prepared.feedback_token is not None:  # only the client that got the completion can reward it
        head["dtrain_feedback_token"] = prepared.feedback_token
    return head


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    state, prepared, stream, include_usage = await _start(request, chat)
    run = _Run(state, prepared)
    try:
        if stream:
            return await _stream(request, run, chat, include_usage)
        return await _whole(run, chat)
    finally:
        run.ticket.cancel()  # no-op once done; frees the rows of a client that went away


async def _whole(run: _Run, chat: bool) -> web.Response:
    n = run.prepared.generation.n
    tokens: list[list[TokenLogprob]] = [[] for _ in range(n)]
    while True:
        event = await run.next()
        if isinstance(event, Delta):
            tokens[event.choice].extend(event.logprobs)
        elif isinstance(event, Failed):
            raise OpenAIError(500, event.message, kind="server_error")
        elif isinstance(event, Done):
            break
    await run.record()
    ticket, want_logprobs = run.ticket, run.prepared.generation.params.logprobs is not None
    choices = []
    for i in range(n):
        choice = {"index": i, "finish_reason": ticket.finish_reasons[i]}
        if chat:
            choice["message"] = {"role": "assistant", "content": ticket.texts[i]}
            choice["logprobs"] = chat_logprobs(tokens[i]) if want_logprobs else None
        else:
            choice["text"] = ticket.texts[i]
            choice["logprobs"] = completion_logprobs(tokens[i]) if want_logprobs else None
        choices.append(choice)
    answer = _head(run.prepared, ticket.step, "chat.completion" if chat else "text_completion")
    answer["choices"] = choices
    answer["usage"] = usage(len(run.prepared.generation.prompt_ids), ticket.completion_tokens)
    return web.json_response(answer)


def _sse(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


async def _stream(request: web.Request, run: _Run, chat: bool, include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        await _events(response, run, chat, include_usage)
    except ConnectionResetError:  # the client went away: its rows leave the batch (the caller cancels), no record
        logger.info(f"{run.prepared.id}: the client closed the stream")
    return response


async def _events(response: web.StreamResponse, run: _Run, chat: bool, include_usage: bool) -> None:
    ticket, want_logprobs = run.ticket, run.prepared.generation.params.logprobs is not None
    obj = "chat.completion.chunk" if chat else "text_completion"
    offsets = [0] * run.prepared.generation.n
    started: set[int] = set()

    def chunk(choices: list, **extra) -> dict:
        return {**_head(run.prepared, ticket.step, obj), "choices": choices, **extra}

    while True:
        event = await run.next()
        if isinstance(event, Failed):
            await response.write(_sse(error_body(event.message, "server_error")))
            return
        if isinstance(event, Done):
            break
        i = event.choice
        if chat:
            delta: dict = {}
            if i not in started:
                started.add(i)
                delta["role"] = "assistant"
            if isinstance(event, Delta):
                delta["content"] = event.text
                logprobs = chat_logprobs(list(event.logprobs)) if want_logprobs else None
                await response.write(_sse(chunk([{"index": i, "delta": delta, "logprobs": logprobs,
                                                  "finish_reason": None}])))
            else:
                await response.write(_sse(chunk([{"index": i, "delta": delta, "logprobs": None,
                                                  "finish_reason": event.reason}])))
        elif isinstance(event, Delta):
            logprobs = completion_logprobs(list(event.logprobs), offsets[i]) if want_logprobs else None
            offsets[i] += len(event.text)
            await response.write(_sse(chunk([{"index": i, "text": event.text, "logprobs": logprobs,
                                              "finish_reason": None}])))
        elif isinstance(event, Finish):
            await response.write(_sse(chunk([{"index": i, "text": "", "logprobs": None,
                                              "finish_reason": event.reason}])))
    await run.record()
    if include_usage:
        await response.write(_sse(chunk([], usage=usage(len(run.prepared.generation.prompt_ids),
                                                        ticket.completion_tokens))))
    await response.write(_sse("[DONE]"))
    await response.write_eof()


# ---- models and feedback

def _model_entry(service: ServeService, name: str) -> dict:
    step = service.current_step()
    entry = {"id": name, "object": "model", "created": 0, "owned_by": "dtrain",
             "dtrain_step": step, "context_length": service.max_seq_len,
             "dtrain_expert": name != service.model_name}
    adapter = service.adapter.state() if service.adapter is not None else None
    if adapter is not None and adapter.name == name:  # the --feedback-lora adapter: which version serves now
        entry["dtrain_adapter"] = {"epoch": adapter.epoch, "sha256": adapter.sha256, "samples": adapter.samples,
                                   "peers": adapter.peers}
    return entry


def capture_json(config) -> dict:
    """What this node keeps of what it serves, for clients to read before they send anything."""
    return {"recording": config.capture, "max_rows": config.capture_max_rows if config.capture else 0}


async def models(request: web.Request) -> web.Response:
    service = request.app[SERVE].service
    return web.json_response({"object": "list", "data": [_model_entry(service, m) for m in service.models()],
                              "dtrain_capture": capture_json(service.config)})


async def model(request: web.Request) -> web.Response:
    service = request.app[SERVE].service
    name = request.match_info["model"]
    if name not in service.models():
        raise OpenAIError(404, f"the model {name!r} does not exist on this node; it serves {service.models()}",
                          param="model", code="model_not_found")
    return web.json_response(_model_entry(service, name))


async def feedback(request: web.Request) -> web.Response:
    state = request.app[SERVE]
    body = await _json_body(request, state)
    try:
        cid, reward, index, token = parse_feedback(body)
    except OpenAIRequestError as e:
        raise _bad(e) from None
    try:
        changed = await _in_worker(state, state.service.feedback, cid, reward, index, token)
    except CaptureOffError as e:
        raise OpenAIError(404, str(e), param="id", code="capture_off") from None
    except FeedbackForbidden as e:
        raise OpenAIError(403, str(e), kind="permission_error", param="feedback_token",
                          code="feedback_forbidden") from None
    except CaptureError as e:
        raise OpenAIError(404, str(e), param="id", code="completion_not_found") from None
    return web.json_response({"id": cid, "reward": reward, "index": index, "updated": changed})


# ---- wiring

async def _executor_ctx(app: web.Application):
    state = app[SERVE]
    state.executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="serve")
    yield
    state.executor.shutdown(wait=False, cancel_futures=True)


def add_routes(app: web.Application, service: ServeService) -> None:
    app[SERVE] = ServeState(service=service)
    app.cleanup_ctx.append(_executor_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/v1/feedback", feedback)
