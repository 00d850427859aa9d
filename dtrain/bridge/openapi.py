"""The OpenAPI 3.1 description of every HTTP route of a node, served at /api/v1/openapi.json.

The document is written here by hand (the handlers stay plain aiohttp), so two checks keep it true:
- at start-up the app refuses to run with a registered route the document lacks (`undocumented_routes`);
- tests/test_openapi.py makes a real node answer every documented status of every operation, and checks
  that it answered no status the document lacks (counted by /metrics' dtrain_http_requests_total).
`default` responses (an unexpected 500 "internal error") are not status codes and are not checked.
"""
from __future__ import annotations

import json

from aiohttp import web
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

JSON, BYTES, TEXT, HTML = "application/json", "application/octet-stream", "text/plain", "text/html"
SSE = "text/event-stream"
OPENAPI_ROUTE = "/api/v1/openapi.json"
_METHODS = ("get", "post", "put", "delete", "patch", "head", "options")


class OpenApiError(RuntimeError):
    """A route is registered but not described: add it to bridge/openapi.py."""


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(description: str, schema: dict, headers: tuple[str, ...] = ()) -> dict:
    answer = {"description": description, "content": {JSON: {"schema": schema}}}
    if headers:
        answer["headers"] = {h: {"$ref": f"#/components/headers/{h}"} for h in headers}
    return answer


def _bytes(description: str, headers: tuple[str, ...] = (), media: str = BYTES) -> dict:
    answer = {"description": description, "content": {media: {"schema": {"type": "string", "format": "binary"}}}}
    if headers:
        answer["headers"] = {h: {"$ref": f"#/components/headers/{h}"} for h in headers}
    return answer


def _error(description: str) -> dict:
    return _json(description, _ref("Error"))


def _query(name: str, description: str, schema: dict) -> dict:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


def _op(summary: str, tag: str, responses: dict, parameters: tuple = (), body: dict | None = None) -> dict:
    op = {"summary": summary, "tags": [tag],
          "responses": {**{str(k): v for k, v in responses.items()},
                        "default": {"$ref": "#/components/responses/Unexpected"}}}
    if parameters:
        op["parameters"] = list(parameters)
    if body is not None:
        op["requestBody"] = body
    return op


_FORMAT = _query("format", "transport format: f16 (2 bytes/element) or f32 (4)", {"enum": ["f16", "f32"], "default": "f16"})
_LENGTH_ERRORS = {411: _error("no Content-Length (chunked bodies are refused)"),
                  413: _error("body larger than the limit")}


def _openai_error(description: str) -> dict:
    return _json(description, _ref("OpenAIError"))


def _openai_paths() -> dict:
    tag = "OpenAI-compatible API"
    generation_errors = {
        400: _openai_error("a field is missing, of the wrong type or out of the node's bounds (`param` names it), "
                           "or the prompt does not fit the context (code context_length_exceeded)"),
        404: _openai_error("no such model on this node (code model_not_found)"),
        429: _openai_error("the running batch and the queue behind it are full (code queue_full); retry later"),
        **_LENGTH_ERRORS,
    }

    def generation(summary: str, request: str, answer: str) -> dict:
        return {"post": _op(summary, tag, {
            200: {"description": "the completion; with stream: true, server-sent events (`data: {chunk}` per text "
                                 "piece, then `data: [DONE]`), without a Content-Length",
                  "content": {JSON: {"schema": _ref(answer)}, SSE: {"schema": {"type": "string"}}}},
            **generation_errors,
        }, body={"required": True, "content": {JSON: {"schema": _ref(request)}}})}

    return {
        "/v1/completions": generation("Complete a prompt with the shared model at its current step (or a LoRA "
                                      "expert by name)", "CompletionRequest", "Completion"),
        "/v1/chat/completions": generation("Answer a conversation (the chat template of docs/serving.md)",
                                           "ChatRequest", "ChatCompletion"),
        "/v1/models": {"get": _op("The models this node serves: the shared model, then its LoRA experts", tag, {
            200: _json("models", {"type": "object", "required": ["object", "data", "dtrain_capture"], "properties": {
                "object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")},
                "dtrain_capture": {"type": "object", "required": ["recording", "max_rows"], "description": (
                    "whether this node records what it serves (its operator set --capture-db): prompt, completion, "
                    "token ids, step and timing of every /v1 completion, the newest max_rows kept"), "properties": {
                        "recording": {"type": "boolean"}, "max_rows": {"type": "integer", "minimum": 0}}}}})})},
        "/v1/models/{model}": {"get": _op("One served model", tag, {
            200: _json("the model", _ref("Model")),
            404: _openai_error("no such model on this node"),
        }, parameters=({"name": "model", "in": "path", "required": True, "schema": {"type": "string"}},))},
        "/v1/feedback": {"post": _op("Attach a reward in [-1, 1] to a completion this node served (and recorded); "
                                     "only the client that got it can, with its dtrain_feedback_token", tag, {
            200: _json("rows updated", {"type": "object", "required": ["id", "reward", "updated"]}),
            400: _openai_error("id, reward, index or feedback_token is missing or out of range"),
            403: _openai_error("the feedback_token is not the one the completion was served with (code "
                               "feedback_forbidden); nothing is changed"),
            404: _openai_error("no such completion is recorded (code completion_not_found), or the node records "
                               "nothing (code capture_off)"),
            **_LENGTH_ERRORS,
        }, body={"required": True, "content": {JSON: {"schema": {"type": "object",
                                                                  "required": ["id", "reward", "feedback_token"],
                                                                  "properties": {
            "id": {"type": "string"}, "reward": {"type": "number", "minimum": -1, "maximum": 1},
            "feedback_token": {"type": "string", "description": "the completion's dtrain_feedback_token"},
            "index": {"type": "integer", "minimum": 0, "description": "one choice; default: every choice"}}}}}})},
    }


def _paths() -> dict:
    train, split, pages, ops = "Training API v1", "Split inference", "Pages and files", "Operations"
    tensor_headers = ("X-Model-Step", "X-Tensor-Id", "X-Tensor-Offset", "X-Tensor-Count", "X-Tensor-Format")
    return {
        "/healthz": {"get": _op("Liveness", ops, {200: _json("alive", {"const": {"ok": True}})})},
        "/api/v1/model/info": {"get": _op("Model step, size, shape and optimizer settings", train,
                                          {200: _json("model info", _ref("ModelInfo"))})},
        "/api/v1/model/manifest": {"get": _op("Tensor ids, names, shapes and sizes, in a stable order", train,
                                              {200: _json("manifest", _ref("Manifest"))})},
        "/api/v1/model/tensor/{id}": {"get": _op(
            "One tensor's elements [offset, offset+count) at the current step, little-endian", train, {
                200: _bytes("the elements, all of one step (X-Model-Step)", tensor_headers),
                400: _error("id, format, offset or count is not valid"),
                404: _error("no tensor with this id"),
                416: _error("offset + count is past the tensor's elements"),
            }, parameters=(
                {"name": "id", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}},
                _FORMAT,
                _query("offset", "first element", {"type": "integer", "minimum": 0, "default": 0}),
                _query("count", "elements (default: to the end)", {"type": "integer", "minimum": 0}),
            ))},
        "/api/v1/train/submit": {"post": _op(
            "Submit one DGRD gradient packet computed at a recent step", train, {
                200: _json("accepted", _ref("SubmitOk")),
                400: _error("malformed packet (the message names the field), or samples above "
                            "max_samples_per_packet (the message names the cap); carries server_step"),
                401: _json("a closed node (--contributor-tokens) and no 'Authorization: Bearer <token>' naming one "
                           "of its tokens; answered before the body is read, nothing applied",
                           _ref("Error"), ("WWW-Authenticate",)),
                403: _error("this node_id is scored out: too few of its recent contributions agreed with the node's "
                            "own gradient (the message says how many); nothing applied (docs/robustness.md)"),
                409: _error("the packet's step is outside the late window; fetch the latest model (server_step)"),
                429: _json("this node_id (or, with an address limit, this client address) is over its rate limit "
                           "(--rate-limit, --rate-burst); nothing applied, retry after Retry-After seconds",
                           _ref("Error"), ("Retry-After",)),
                503: _json("the node holds --max-pending-mib of accepted packets its training thread has not taken "
                           "yet (it takes none during an update); nothing applied, retry after Retry-After seconds",
                           _ref("Error"), ("Retry-After",)),
                **_LENGTH_ERRORS,
            }, body={"required": True, "description": "a DGRD packet (docs/ and bridge/dgrd.py)",
                     "content": {BYTES: {"schema": {"type": "string", "format": "binary"}}}})},
        "/api/v1/server/losses": {"get": _op("Training loss of every update, oldest first", train, {
            200: _json("losses", {"type": "array", "items": {"type": "number"}})})},
        "/api/v1/data/batch": {"get": _op(
            "Random token windows of the node's text (--train-data, else the default corpus)", train, {
                200: _bytes("batch_size x seq_len uint32 token ids, little-endian",
                            ("X-Batch-Size", "X-Seq-Len", "X-Model-Step")),
                400: _error("batch_size or seq_len out of range"),
                404: _error("the node hands out no data (--no-data)"),
            }, parameters=(
                _query("batch_size", "sequences (1..256)", {"type": "integer", "minimum": 1, "maximum": 256, "default": 8}),
                _query("seq_len", "tokens per sequence (2..max_seq_len)", {"type": "integer", "minimum": 2, "default": 64}),
            ))},
        "/api/v1/swarm/status": {"get": _op("The node's view of the swarm and its contributors", ops, {
            200: _json("status", _ref("SwarmStatus"))})},
        "/api/v1/contributors": {"get": _op("The contributor ledger: per node_id, packets accepted, rejected by "
                                            "reason, treated as outliers, samples credited, last seen", ops, {
            200: _json("ledger", {"type": "object", "required": ["summary", "contributors"]})})},
        "/api/v1/split/stream": {"get": _op(
            "WebSocket of the split protocol: ping, config, tokenize and forward messages as JSON text", split, {
                101: {"description": "switched to a WebSocket"},
                400: _error("not a WebSocket upgrade request"),
            })},
        "/api/v1/split/config": {"get": _op("The served model's split facts, DP and HE settings", split, {
            200: _json("config message", {"type": "object", "required": ["type", "hidden_size", "max_seq_len"]})})},
        "/api/v1/split/forward": {"post": _op(
            "Run the transformer blocks on client hidden states (optionally KV-cached per session)", split, {
                200: _json("pre-activations and timings", _ref("ForwardAnswer")),
                400: _error("invalid message or session (the `code` names the error)"),
                **_LENGTH_ERRORS,
            }, body={"required": True, "content": {JSON: {"schema": _ref("ForwardRequest")}}})},
        "/api/v1/split/tokenize": {"post": _op("GPT-2 (or the split model's) token ids of a text", split, {
            200: _json("token ids", {"type": "object", "properties": {
                "type": {"const": "tokenize"}, "token_ids": {"type": "array", "items": {"type": "integer"}},
                "length": {"type": "integer"}}}),
            400: _error("invalid message"),
            **_LENGTH_ERRORS,
        }, body={"required": True, "content": {JSON: {"schema": {"type": "object", "required": ["text"], "properties": {
            "type": {"const": "tokenize"}, "text": {"type": "string"}}}}}})},
        **{f"/api/v1/split/{which}": {"get": _op(
            f"The --split-model's {which} matrix [vocab, hidden], little-endian", split, {
                200: _bytes("the matrix", ("X-Model-Step", "X-Tensor-Format", "X-Tensor-Count")),
                400: _error("format is not f16 or f32"),
                404: _error("the shared model serves it as a tensor of /api/v1/model/tensor (or the head is tied)"),
            }, parameters=(_FORMAT,))} for which in ("embedding", "lm_head")},
        "/metrics": {"get": _op("Prometheus metrics of the node and its bridge", ops, {
            200: {"description": "Prometheus text format 0.0.4", "content": {TEXT: {"schema": {"type": "string"}}}}})},
        OPENAPI_ROUTE: {"get": _op("This document", ops, {200: _json("OpenAPI 3.1", {"type": "object"})})},
        "/static/model_config.json": {"get": _op("The model config the node loaded", train, {
            200: _json("model config", {"type": "object"})})},
        "/static/train_config.json": {"get": _op("The optimizer config the node loaded", train, {
            200: _json("optimizer config", {"type": "object"})})},
        "/static/{name}": {"get": _op("A file of the static directory: scripts, tokenizer files, bundles", pages, {
            200: {"description": "the file", "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}},
            404: _error("no such file"),
        }, parameters=({"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},))},
        "/": {"get": _op("Dashboard page", pages, {200: _bytes("HTML page", media=HTML)})},
        "/contribute": {"get": _op("Train in this browser (TensorFlow.js)", pages, {200: _bytes("HTML page", media=HTML)})},
        "/chat": {"get": _op("Split-inference chat", pages, {200: _bytes("HTML page", media=HTML)})},
        **_openai_paths(),
    }


def _headers() -> dict:
    described = {
        "X-Model-Step": "model step the bytes belong to", "X-Tensor-Id": "tensor id",
        "X-Tensor-Offset": "first element", "X-Tensor-Count": "elements in the body",
        "X-Tensor-Format": "f16 or f32", "X-Batch-Size": "sequences in the body", "X-Seq-Len": "tokens per sequence",
        "Retry-After": "whole seconds until the contributor's rate limit (429) or the node (503) may take a packet",
        "WWW-Authenticate": "Bearer realm=\"dtrain\"",
    }
    strings = ("X-Tensor-Format", "WWW-Authenticate")
    return {name: {"description": text, "schema": {"type": "string" if name in strings else "integer"}}
            for name, text in described.items()}


def _schemas() -> dict:
    integer, number, string = {"type": "integer"}, {"type": "number"}, {"type": "string"}
    return {
        "Error": {"type": "object", "required": ["ok", "message"], "properties": {
            "ok": {"const": False}, "message": string,
            "server_step": {**integer, "description": "the node's step (submit answers)"},
            "code": {**string, "description": "split errors: a stable name such as stale_session"}}},
        "ModelInfo": {"type": "object", "required": ["step", "updates", "total_params", "config", "train"],
                      "properties": {"step": integer, "updates": integer, "total_params": integer,
                                     "config": {"type": "object"}, "train": {"type": "object"}}},
        "Manifest": {"type": "object", "required": ["step", "tensors"], "properties": {
            "step": integer, "tensors": {"type": "array", "items": {"type": "object", "properties": {
                "id": integer, "name": string, "shape": {"type": "array", "items": integer}, "elements": integer}}}}},
        "SubmitOk": {"type": "object", "required": ["ok", "server_step"], "properties": {
            "ok": {"const": True}, "message": string, "server_step": integer}},
        "SwarmStatus": {"type": "object", "required": ["step", "updates", "peers", "contributors"], "properties": {
            "step": integer, "updates": integer, "peers": integer, "training_peers": integer,
            "nodes": {"type": "array", "items": {"type": "object"}}, "peer_id": string,
            "maddrs": {"type": "array", "items": string}, "contributors": integer, "samples_total": integer,
            "pending_contributors": integer, "params_sha256": string,
            "accepted_packets": integer, "accepted_samples": integer, "applied_packets": integer,
            "applied_samples": integer, "carried_packets": integer, "carried_samples": integer,
            "pending_samples": integer, "last_update_s": {"type": "number"}, "skipped_rounds": integer,
            "round_samples": {"type": "integer", "description": "low-comm: samples of the node's own data trained "
                              "while its outer rounds ran, each round's the first inner update of the next"},
            "closed": {"type": "boolean", "description": "a closed swarm (--swarm-key): only peers that hold the key "
                       "can join; open otherwise (docs/peers.md)"},
            "sync": {"enum": ["per-step", "low-comm"]},
            "first_state": {"enum": ["founder", "checkpoint", "own state", "download"], "description": "how the "
                            "state of the node's first served step came: it started the swarm, its checkpoint held "
                            "the swarm's bytes, it built the swarm's start itself (a joiner at epoch 0: no "
                            "download), or a download from peers"},
            "device": {"type": "object", "description": "where forward and backward passes run (--device); the "
                       "fp32 master weights stay on the CPU", "properties": {
                "device": string, "name": string, "precision": {"enum": ["fp32", "bf16 autocast"]}}},
            "torch_threads": {"type": "object", "description": "threads one torch operation on the CPU uses, in "
                              "every engine of the node (--torch-threads)", "properties": {
                "intra_op": integer, "inter_op": integer}},
            "wire_codec": {"enum": ["fp16", "fp32", "sparse", None], "description": "low-comm: the pseudo-gradient "
                           "on the wire (null in per-step mode)"},
            "reachability": {"type": "object", "description": "how this node takes part in the swarm "
                             "(docs/home-nodes.md): mode public (a full peer) or client (dials out only), and what "
                             "the dial-back check at start found", "properties": {
                "mode": {"enum": ["public", "client"]}, "verdict": {"enum": ["reachable", "unreachable", "unchecked"]},
                "asked": integer, "answered": integer, "dialed": integer, "relay": {"type": "boolean"},
                "chosen_by": {"enum": ["check", "flag"]}, "detail": string}}}},
        "ForwardRequest": {"type": "object", "required": ["hidden_states", "seq_len", "hidden_dim"], "properties": {
            "type": {"const": "forward"}, "hidden_states": {**string, "description": "base64 float32 [seq_len, hidden_dim]"},
            "seq_len": integer, "hidden_dim": integer, "session_id": string, "incremental": {"type": "boolean"},
            "expert_name": string, "use_he": {"type": "boolean"}}},
        "ForwardAnswer": {"type": "object", "required": ["type", "pre_activations", "seq_len", "hidden_dim"],
                          "properties": {
            "type": {"const": "forward"}, "pre_activations": {**string, "description": "base64 float32"},
            "seq_len": integer, "hidden_dim": integer, "he_active": {"type": "boolean"}, "encrypt_ms": number,
            "compute_ms": number, "decrypt_ms": number, "total_ms": number, "dp_sigma": number,
            "incremental": {"type": "boolean"}, "cached_seq_len": integer, "session_id": {"type": ["string", "null"]},
            "step": integer}},
        **_openai_schemas(),
    }


def _openai_schemas() -> dict:
    integer, number, string, nullable = {"type": "integer"}, {"type": "number"}, {"type": "string"}, {"type": "null"}
    sampling = {
        "model": {**string, "description": "the shared model's name or a LoRA expert's (GET /v1/models)"},
        "max_tokens": {**integer, "minimum": 1, "description": "at most --serve-max-tokens, and prompt + max_tokens "
                                                               "within the context"},
        "temperature": {**number, "minimum": 0, "maximum": 2, "default": 1, "description": "0: greedy"},
        "top_p": {**number, "exclusiveMinimum": 0, "maximum": 1, "default": 1},
        "n": {**integer, "minimum": 1, "description": "at most --serve-max-n", "default": 1},
        "stop": {"oneOf": [string, {"type": "array", "maxItems": 4, "items": string}, nullable]},
        "seed": integer, "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    }
    head = {"id": string, "created": integer, "model": string,
            "system_fingerprint": {**string, "description": "dtrain-step-N: the model step that wrote it"},
            "dtrain_step": {**integer, "description": "the model step that wrote it"},
            "dtrain_feedback_token": {**string, "description": "present when the node records what it serves: "
                                                               "the secret POST /v1/feedback needs to reward it"},
            "usage": {"type": "object", "properties": {"prompt_tokens": integer, "completion_tokens": integer,
                                                       "total_tokens": integer}}}
    reason = {"enum": ["stop", "length"]}
    return {
        "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": string, "type": string, "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]}}}}},
        "CompletionRequest": {"type": "object", "required": ["model", "prompt"], "properties": {
            **sampling, "prompt": {"oneOf": [string, {"type": "array", "items": integer}]},
            "logprobs": {**integer, "minimum": 0, "maximum": 5}}},
        "ChatRequest": {"type": "object", "required": ["model", "messages"], "properties": {
            **sampling, "messages": {"type": "array", "items": {"type": "object", "required": ["role", "content"],
                                                                "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]},
                                                                               "content": string}}},
            "max_completion_tokens": integer, "logprobs": {"type": "boolean"},
            "top_logprobs": {**integer, "minimum": 0, "maximum": 5}}},
        "Completion": {"type": "object", "required": ["id", "object", "choices", "dtrain_step"], "properties": {
            **head, "object": {"const": "text_completion"}, "choices": {"type": "array", "items": {
                "type": "object", "properties": {"index": integer, "text": string, "finish_reason": reason,
                                                 "logprobs": {"type": ["object", "null"]}}}}}},
        "ChatCompletion": {"type": "object", "required": ["id", "object", "choices", "dtrain_step"], "properties": {
            **head, "object": {"const": "chat.completion"}, "choices": {"type": "array", "items": {
                "type": "object", "properties": {"index": integer, "finish_reason": reason,
                                                 "message": {"type": "object", "properties": {
                                                     "role": {"const": "assistant"}, "content": string}},
                                                 "logprobs": {"type": ["object", "null"]}}}}}},
        "Model": {"type": "object", "required": ["id", "object"], "properties": {
            "id": string, "object": {"const": "model"}, "owned_by": string, "created": integer,
            "dtrain_step": {**integer, "description": "the model step a request sent now is served at"},
            "context_length": integer, "dtrain_expert": {"type": "boolean"},
            "dtrain_adapter": {"type": "object", "description": "the --feedback-lora adapter's version as served now",
                               "required": ["epoch", "sha256", "samples", "peers"], "properties": {
                                   "epoch": {**integer, "description": "updates of the adapter"},
                                   "sha256": {**string, "description": "of A then B as little-endian float32"},
                                   "samples": {**integer, "description": "rewarded rows this node put in"},
                                   "peers": {**integer, "description": "peers whose gradients its last update "
                                                                       "averaged (0: none yet, or downloaded)"}}}}},
    }


def document() -> dict:
    """The whole OpenAPI document (a fresh dict each call)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "dtrain node",
            "version": "1",
            "description": (
                "One node of a dtrain swarm: Training API v1 (../shared/spec/training-server-api-v1.md), split "
                "inference (../shared/spec/split-inference-protocol.md), an OpenAI-compatible API (/v1), the swarm's "
                "status, metrics and pages. Every answer but a /v1 event stream has a Content-Length; every answer "
                "has CORS headers; every path answers an OPTIONS preflight with "
                "204; an unknown path answers 404 and a known path with another method 405, as JSON errors."),
        },
        "tags": [{"name": t} for t in ("Training API v1", "Split inference", "OpenAI-compatible API", "Operations",
                                       "Pages and files")],
        "paths": _paths(),
        "components": {
            "schemas": _schemas(),
            "headers": _headers(),
            "responses": {"Unexpected": {"description": "a bug of the node: logged, answered as 'internal error'",
                                         "content": {JSON: {"schema": _ref("Error")}}}},
        },
    }


def operations(doc: dict) -> set[tuple[str, str]]:
    """(METHOD, path template) of every operation in `doc`."""
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item if method in _METHODS}


def undocumented_routes(app: web.Application, doc: dict) -> list[str]:
    """'METHOD /template' of each route registered in `app` that `doc` lacks (HEAD comes with its GET)."""
    documented = operations(doc)
    registered = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    missing = set()
    for method, path in registered:
        if method == "HEAD" and ("GET", path) in registered:  # aiohttp adds HEAD to every GET route
            continue
        if (method, path) not in documented:
            missing.add(f"{method} {path}")
    return sorted(missing)


OPENAPI_BODY = web.AppKey("openapi_body", bytes)


async def _check(app: web.Application) -> None:
    missing = undocumented_routes(app, document())
    if missing:
        raise OpenApiError(f"route(s) {missing} are not in the OpenAPI document: describe them in bridge/openapi.py")


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI_BODY], content_type=JSON)


def setup(app: web.Application) -> None:
    """Serve the document; refuse to start with a route it does not describe."""
    app[OPENAPI_BODY] = json.dumps(document(), indent=1).encode()
    app.router.add_get(OPENAPI_ROUTE, openapi_json)
    app.on_startup.append(_check)
