"""The serving side of a node as the bridge sees it: typed requests in, tickets out, every completion recorded.

`prepare` (on a worker thread: it tokenizes) turns a validated request into the engine's Generation, checking what
only the node knows: the model name, the prompt's tokens against the context length. `submit` queues it.
`record` writes the finished completion into the capture store. The bridge never touches the engine or the db.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from hivemind.utils.logging import get_logger

from dtrain.node.serve import chat_template
from dtrain.node.serve.capture import CaptureStore, Record, token_hash
from dtrain.node.serve.config import ServeConfig
from dtrain.node.serve.engine import Event, Generation, ServeEngine, ServeError, Ticket
from dtrain.node.serve.sampling import SamplingParams

logger = get_logger(__name__)

COMPLETIONS, CHAT = "text_completion", "chat.completion"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class UnknownModelError(ServeError):
    """The request names a model this node does not serve."""


class ContextLengthError(ServeError):
    """The prompt (with max_tokens) does not fit into the model's positions."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param  # the request field to blame: prompt, messages or max_tokens


class CaptureOffError(ServeError):
    """Feedback was sent to a node that records nothing (no --capture-db)."""


@dataclass(frozen=True)
class CompletionRequest:
    """A /v1 request after the bridge validated every field's type and range (not yet tokenized)."""

    kind: str  # COMPLETIONS or CHAT
    model: str
    prompt: Optional[str] = None  # completions: the prompt text ...
    prompt_ids: Optional[tuple[int, ...]] = None  # ... or its token ids
    messages: Optional[tuple[tuple[str, str], ...]] = None  # chat: (role, content), oldest first
    max_tokens: Optional[int] = None  # None: the endpoint's default, bounded by the context
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    parameters: Optional[dict] = None  # what the client sent (minus the prompt), for the record


@dataclass(frozen=True)
class Prepared:
    id: str  # the completion id the client gets
    created: int  # unix seconds
    request: CompletionRequest
    prompt_text: str  # what the model reads (chat: the rendered template)
    generation: Generation
    feedback_token: Optional[str] = None  # what the client presents to reward it; None when nothing is recorded


class ServeService:
    def __init__(self, engine: ServeEngine, tokenizer: Any, model_name: str, config: ServeConfig,
                 capture: Optional[CaptureStore] = None, trainer=None, adapter=None):
        self.engine = engine
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.model_name = model_name
        self.config = config
        self.capture = capture
        self.trainer = trainer  # node.serve.feedback.FeedbackTrainer with --feedback-train, else None
        self.adapter = adapter  # node.serve.adapter.AdapterTrainer with --feedback-lora, else None
        self.vocab_size = int(engine.vocab_size)

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    def models(self) -> list[str]:
        """The shared model first, then every hosted LoRA expert."""
        return [self.model_name, *self.engine.experts.names()]

    def current_step(self) -> int:
        """The model step a request sent now is served at."""
        return self.engine.node_step()

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()
        if self.adapter is not None:
            self.adapter.stop()
        self.engine.stop()
        if self.capture is not None:
            self.capture.close()

    # ---- a request's life

    def prepare(self, request: CompletionRequest) -> Prepared:
        if request.model == self.model_name:
            expert = None
        elif request.model in self.engine.experts:
            expert = request.model
        else:
            raise UnknownModelError(f"the model {request.model!r} does not exist on this node; it serves "
                                    f"{self.models()} (GET /v1/models)")
        stop = request.stop
        if request.kind == CHAT:
            text = chat_template.render(request.messages)
            ids = self._encode(text)
            stop = tuple(dict.fromkeys(stop + chat_template.STOP))
            param = "messages"
        elif request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            text = self.tokenizer.decode(ids)
            param = "prompt"
        else:
            text, ids, param = request.prompt, self._encode(request.prompt), "prompt"
        if not ids:  # an empty prompt starts from end-of-text, as GPT-2 was trained to begin a document
            ids = [self.engine.eos_token_id if self.engine.eos_token_id is not None else 0]
        room = self.max_seq_len - len(ids)
        if room < 1:
            raise ContextLengthError(f"the model's context is {self.max_seq_len} tokens and the {param} has "
                                     f"{len(ids)}; shorten it", param)
        max_tokens = request.max_tokens
        if max_tokens is None:
            default = DEFAULT_COMPLETION_TOKENS if request.kind == COMPLETIONS else self.config.max_tokens
            max_tokens = min(default, self.config.max_tokens, room)
        elif max_tokens > room:
            raise ContextLengthError(f"the model's context is {self.max_seq_len} tokens: {len(ids)} in the {param} "
                                     f"and max_tokens {max_tokens} do not fit; ask for at most {room}", "max_tokens")
        params = SamplingParams(max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
                                seed=request.seed, stop=stop, logprobs=request.logprobs)
        prefix = "chatcmpl-" if request.kind == CHAT else "cmpl-"
        token = secrets.token_urlsafe(24) if self.capture is not None else None
        return Prepared(id=prefix + secrets.token_hex(12), created=int(time.time()), request=request, prompt_text=text,
                        generation=Generation(tuple(ids), params, n=request.n, expert=expert,
                                              strip_leading=request.kind == CHAT),
                        feedback_token=token)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def submit(self, prepared: Prepared, on_event: Callable[[Event], None]) -> Ticket:
        return self.engine.submit(prepared.generation, on_event)

    def record(self, prepared: Prepared, ticket: Ticket) -> None:
        """Write a finished completion's choices into the capture store (nothing without --capture-db)."""
        if self.capture is None or ticket.step is None:
            return
        req = prepared.request
        params = dict(req.parameters or {})
        if req.messages is not None:
            params["messages"] = [{"role": r, "content": c} for r, c in req.messages]
        records = [Record(id=prepared.id, choice=i, created=ticket.submitted_at, endpoint=req.kind, model=req.model,
                          expert=prepared.generation.expert, step=ticket.step, prompt=prepared.prompt_text,
                          prompt_ids=prepared.generation.prompt_ids, completion=ticket.texts[i],
                          completion_ids=tuple(ticket.token_ids[i]), finish_reason=ticket.finish_reasons[i] or "",
                          params=params, queue_ms=ticket.queue_ms, first_token_ms=ticket.first_token_ms,
                          total_ms=ticket.total_ms,
                          feedback_hash=token_hash(prepared.feedback_token) if prepared.feedback_token else None)
                   for i in range(prepared.generation.n)]
        self.capture.record(records)

    def feedback(self, completion_id: str, reward: float, choice: Optional[int], token: str) -> int:
        if self.capture is None:
            raise CaptureOffError("this node records no completions (its operator did not set --capture-db), so it "
                                  "takes no feedback")
        return self.capture.feedback(completion_id, reward, choice, token)


def for_node(node, config: ServeConfig, tokenizer: Any, experts=None, models=None) -> ServeService:
    """The serving service of a started TrainingNode: its shared model at the step it serves, started. `models`:
    the node's node.frozen.SnapshotModels, shared with split inference (one of its own when None)."""
    from dtrain.node.frozen import SnapshotModels
    from dtrain.node.model import meta_template
    from dtrain.node.serve.weights import SnapshotWeights

    model_config = node.model_config
    template = meta_template(model_config)  # shapes only: each engine reads the snapshot's bytes
    if models is None:
        models = SnapshotModels.following(node, template)
    device = node.device.torch_device
    engine = ServeEngine(SnapshotWeights(models, device), lambda ids: tokenizer.decode(list(ids)), config,
                         experts=experts, eos_token_id=template.config.eos_token_id, device=device)
    capture = CaptureStore(config.capture_db, config.capture_max_rows) if config.capture else None
    trainer = None
    if config.feedback_train:
        from dtrain.node.serve.feedback import FeedbackTrainer

        trainer = FeedbackTrainer(node, capture, template, config.feedback_batch, config.feedback_interval_s)
    adapter = None
    if config.feedback_lora is not None:
        from dtrain.node.serve.adapter import AdapterTrainer

        if config.feedback_lora == model_config.name:
            raise ValueError(f"--feedback-lora {config.feedback_lora!r} is the shared model's name; name the "
                             "adapter differently")
        adapter = AdapterTrainer(node, capture, template, engine.experts, config)
    engine.start()
    for background in (trainer, adapter):
        if background is not None:
            background.start()
    training = "off"
    if trainer is not None:
        training = f"the shared model every {config.feedback_interval_s:g} s"
    elif adapter is not None:
        training = f"LoRA adapter {adapter.name!r} every {config.feedback_interval_s:g} s"
    logger.info(f"serving /v1 (OpenAI-compatible) on {model_config.name} and experts {engine.experts.names()}; "
                f"capture {'to ' + str(config.capture_db) if capture else 'off'}; feedback training {training}")
    return ServeService(engine, tokenizer, model_config.name, config, capture, trainer, adapter)
