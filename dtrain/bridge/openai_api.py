"""The OpenAI wire format of /v1: request bodies parsed into typed requests, and answers rendered (pure, no I/O).

Every field is checked for type and range before the node sees it; a bad one raises `OpenAIRequestError` naming
the field (`param`), which the routes answer with OpenAI's error shape and 400. Fields OpenAI defines that this
node does not implement are refused when they would change the answer (echo, suffix, best_of, penalties,
logit_bias, tools), never silently ignored; fields that do not change it (user, metadata, ...) are ignored.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from dtrain.node.serve.chat_template import ROLES
from dtrain.node.serve.config import ServeConfig
from dtrain.node.serve.engine import TokenLogprob
from dtrain.node.serve.service import CHAT, COMPLETIONS, CompletionRequest

MAX_MESSAGES = 512  # messages in one chat request
MAX_MODEL_CHARS = 256
MAX_ID_CHARS = 128  # a completion id in feedback
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)


class OpenAIRequestError(ValueError):
    """A bad /v1 request: the message says what is wrong, `param` names the field."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.code = param, code


def error_body(message: str, kind: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- fields

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, lo: int, hi: int, default: Optional[int], hint: str = "") -> Optional[int]:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not lo <= value <= hi:
        raise OpenAIRequestError(f"{name} must be an integer in [{lo}, {hi}]{hint}, got {value!r}", name)
    return value


def _number(body: dict, name: str, lo: float, hi: float, default: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (lo < value if low_open else lo <= value) or value > hi:
        interval = f"({lo}, {hi}]" if low_open else f"[{lo}, {hi}]"
        raise OpenAIRequestError(f"{name} must be a number in {interval}, got {value!r}", name)
    return float(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIRequestError(f"{name} must be true or false, got {value!r}", name)
    return value


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not 1 <= len(model) <= MAX_MODEL_CHARS:
        raise OpenAIRequestError(f"model must be a model name (GET /v1/models), got {model!r}", "model")
    return model


def _stop(body: dict, config: ServeConfig) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > config.max_stop or not all(
            isinstance(s, str) and 1 <= len(s) <= config.max_stop_chars for s in stops):
        raise OpenAIRequestError(f"stop must be a string or a list of at most {config.max_stop} strings of 1 to "
                                 f"{config.max_stop_chars} characters, got {stop!r}", "stop")
    return tuple(stops)


def _unsupported(body: dict) -> None:
    """Refuse what would change the answer and is not implemented."""
    if body.get("echo"):
        raise OpenAIRequestError("echo is not supported by this node", "echo", "unsupported")
    if body.get("suffix") is not None:
        raise OpenAIRequestError("suffix (insertion) is not supported by this node", "suffix", "unsupported")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise OpenAIRequestError("best_of is not supported by this node (use n)", "best_of", "unsupported")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value not in (None, 0):
            raise OpenAIRequestError(f"{name} is not supported by this node (send 0 or leave it out)", name,
                                     "unsupported")
    if body.get("logit_bias"):
        raise OpenAIRequestError("logit_bias is not supported by this node", "logit_bias", "unsupported")
    for name in ("tools", "functions"):
        if body.get(name):
            raise OpenAIRequestError(f"{name} (function calling) is not supported by this model", name, "unsupported")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise OpenAIRequestError("response_format must be {\"type\": \"text\"}: this model writes plain text",
                                 "response_format", "unsupported")


def _stream_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise OpenAIRequestError(f"stream_options must be an object, got {options!r}", "stream_options")
    return _bool(options, "include_usage")


def _common(body: dict, config: ServeConfig, kind: str) -> dict:
    _unsupported(body)
    n = _int(body, "n", 1, config.max_n, 1, " (the node's --serve-max-n)")
    return dict(kind=kind, model=_model(body),
                temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
                top_p=_number(body, "top_p", 0.0, 1.0, 1.0, low_open=True),
                n=n, stop=_stop(body, config), seed=_int(body, "seed", *SEED_RANGE, None))


def _parameters(body: dict, exclude: str) -> dict:
    """The request's sampling fields as sent, for the capture record (the prompt or messages are recorded apart)."""
    keep = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs",
            "top_logprobs", "stream", "user")
    return {k: body[k] for k in keep if k in body and k != exclude}


# ---- requests

def parse_completion(body: Any, config: ServeConfig, vocab_size: int) -> tuple[CompletionRequest, bool, bool]:
    """(request, stream, include_usage) of a POST /v1/completions body."""
    body = _object(body)
    fields = _common(body, config, COMPLETIONS)
    prompt, prompt_ids = _prompt(body.get("prompt"), config, vocab_size)
    logprobs = _int(body, "logprobs", 0, config.max_logprobs, None)
    max_tokens = _int(body, "max_tokens", 1, config.max_tokens, None, " (the node's --serve-max-tokens)")
    request = CompletionRequest(prompt=prompt, prompt_ids=prompt_ids, max_tokens=max_tokens, logprobs=logprobs,
                                parameters=_parameters(body, "prompt"), **fields)
    return request, _bool(body, "stream"), _stream_usage(body)


def parse_chat(body: Any, config: ServeConfig) -> tuple[CompletionRequest, bool, bool]:
    """(request, stream, include_usage) of a POST /v1/chat/completions body."""
    body = _object(body)
    fields = _common(body, config, CHAT)
    messages = _messages(body.get("messages"), config)
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0, config.max_logprobs, 0)
    elif body.get("top_logprobs") is not None:
        raise OpenAIRequestError("top_logprobs needs logprobs: true", "top_logprobs")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, 1, config.max_tokens, None, " (the node's --serve-max-tokens)")
    request = CompletionRequest(messages=messages, max_tokens=max_tokens, logprobs=logprobs,
                                parameters=_parameters(body, "messages"), **fields)
    return request, _bool(body, "stream"), _stream_usage(body)


def parse_feedback(body: Any) -> tuple[str, float, Optional[int], str]:
    """(completion id, reward, choice index or None for every choice, feedback token) of a POST /v1/feedback body."""
    body = _object(body)
    cid = body.get("id")
    if not isinstance(cid, str) or not 1 <= len(cid) <= MAX_ID_CHARS:
        raise OpenAIRequestError(f"id must be the id of a completion this node served, got {cid!r}", "id")
    token = body.get("feedback_token")
    if not isinstance(token, str) or not 1 <= len(token) <= MAX_ID_CHARS:
        raise OpenAIRequestError("feedback_token is required: the dtrain_feedback_token the completion was served "
                                 "with", "feedback_token")
    if "reward" not in body:
        raise OpenAIRequestError("reward is required: a number in [-1, 1]", "reward")
    reward = _number(body, "reward", -1.0, 1.0, 0.0)
    index = _int(body, "index", 0, 1 << 16, None)
    return cid, reward, index, token


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise OpenAIRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _prompt(prompt: Any, config: ServeConfig, vocab_size: int) -> tuple[Optional[str], Optional[tuple[int, ...]]]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if len(prompt) > config.max_prompt_chars:
            raise OpenAIRequestError(f"prompt of {len(prompt)} characters exceeds the node's {config.max_prompt_chars}",
                                     "prompt", "context_length_exceeded")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if len(prompt) > config.max_prompt_chars or not all(0 <= t < vocab_size for t in prompt):
            raise OpenAIRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise OpenAIRequestError("send one prompt per request (a list of prompts is not supported)", "prompt",
                                 "unsupported")
    raise OpenAIRequestError("prompt must be a string or a list of token ids", "prompt")


def _messages(messages: Any, config: ServeConfig) -> tuple[tuple[str, str], ...]:
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise OpenAIRequestError(f"messages must be a list of 1 to {MAX_MESSAGES} messages", "messages")
    out, chars = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise OpenAIRequestError(f"messages[{i}] must be an object with a role and a content", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text parts are meaningful to this model
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise OpenAIRequestError(f"messages[{i}].content parts must all be text parts", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise OpenAIRequestError(f"messages[{i}].content must be a string", "messages")
        chars += len(content)
        if chars > config.max_prompt_chars:
            raise OpenAIRequestError(f"messages exceed the node's {config.max_prompt_chars} characters", "messages",
                                     "context_length_exceeded")
        if m["role"] not in ROLES:
            raise OpenAIRequestError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {m['role']!r}",
                                     "messages")
        out.append((m["role"], content))
    return tuple(out)


# ---- answers

def fingerprint(step: int) -> str:
    return f"dtrain-step-{step}"


def completion_logprobs(tokens: list[TokenLogprob], start: int = 0) -> dict:
    """The legacy completions `logprobs` object; `start` is the text offset of the first token."""
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{text: lp for text, _, lp in t.top} for t in tokens], "text_offset": offsets}


def chat_logprobs(tokens: list[TokenLogprob]) -> dict:
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(t.text, t.logprob), "top_logprobs": [entry(x, lp) for x, _, lp in t.top]}
                        for t in tokens]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
