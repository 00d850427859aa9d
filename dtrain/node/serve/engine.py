"""The serving engine: one thread decoding every running request together (continuous batching), on the KV cache.

    submit(Generation) ──> waiting (bounded: QueueFullError past it)
                              │ admitted when the batch has room: prefill the prompt once, sample each choice's
                              ▼ first token, join the batch (node.serve.batch: right-aligned rows, one cache)
    decode loop: one forward of every running row per step ──> sample ──> text (stop sequences) ──> events
                              │ a row leaves the batch the step it ends (end of text, stop, length, cancelled)
                              ▼
    Ticket events on the engine thread: Delta (text and the tokens behind it), Finish per choice, Done or Failed.

The engine owns its thread and takes a frozen model of one step (node.serve.weights). The node's step moves while
requests run: the engine keeps serving the step the running rows started on, admits no new request until they
drain, then loads the new step; so every completion is the work of exactly one step (reported in Done).
Nothing here knows HTTP: `on_event` is any callable (the bridge hands events to its event loop).
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from hivemind.utils.logging import get_logger
from transformers import DynamicCache, PreTrainedModel

from dtrain.node.serve.batch import KVBatch
from dtrain.node.serve.config import ServeConfig
from dtrain.node.serve.sampling import SamplingParams, TokenChoice, choose, row_generator
from dtrain.node.serve.text import TextStream
from dtrain.node.serve.weights import ServedWeights
from dtrain.node.split.experts import ExpertRegistry, LoraExpert

logger = get_logger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle loop sleeps unless a request wakes it
ERROR_BACKOFF_S = 1.0  # after a failed iteration (logged), before the next one


class ServeError(Exception):
    """A request the engine cannot take; the message says why."""


class QueueFullError(ServeError):
    """The running batch is full and so is the queue behind it: try again later."""


class EngineStoppedError(ServeError):
    """The engine is not running (not started yet, or shutting down)."""


@dataclass(frozen=True)
class Generation:
    """One request as the engine runs it: token ids in, `n` choices out."""

    prompt_ids: tuple[int, ...]  # at least one token
    params: SamplingParams
    n: int = 1  # choices, each its own row of the batch
    expert: Optional[str] = None  # a LoRA expert on the final hidden state, or the bare shared model
    strip_leading: bool = False  # drop each choice's leading whitespace (chat)


@dataclass(frozen=True)
class TokenLogprob:
    text: str  # the token's text as released (empty for a token inside a multi-byte character)
    token_id: int
    logprob: float
    top: tuple[tuple[str, int, float], ...]  # (text, token id, logprob) of the most likely tokens


@dataclass(frozen=True)
class Delta:
    choice: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token released with `text` (when logprobs were asked)


@dataclass(frozen=True)
class Finish:
    choice: int
    reason: str  # "stop" (end of text or a stop sequence) or "length" (max_tokens or the context)


@dataclass(frozen=True)
class Done:
    pass


@dataclass(frozen=True)
class Failed:
    message: str


Event = Union[Delta, Finish, Done, Failed]


class Ticket:
    """One submitted request: its progress as the engine thread writes it, and `cancel()` for its owner."""

    def __init__(self, generation: Generation, on_event: Callable[[Event], None]):
        self.generation = generation
        self._on_event = on_event
        self._cancelled = threading.Event()
        n = generation.n
        self.texts = [""] * n  # each choice's text so far (what was sent)
        self.token_ids: list[list[int]] = [[] for _ in range(n)]  # each choice's generated tokens (eos excluded)
        self.finish_reasons: list[Optional[str]] = [None] * n
        self.step: Optional[int] = None  # the model step that serves it; set when admitted, before any event
        self.submitted_at = time.time()  # wall clock, for the record
        self._t_submit = time.perf_counter()
        self.queue_ms: Optional[float] = None  # submission to admission
        self.total_ms: Optional[float] = None  # submission to the last token
        self.first_token_ms: Optional[float] = None  # submission to the first released text
        self.done = threading.Event()

    @property
    def completion_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    def cancel(self) -> None:
        """The owner is gone (client disconnected, timed out): the rows leave the batch at the next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _since_submit_ms(self) -> float:
        return (time.perf_counter() - self._t_submit) * 1e3

    def _emit(self, event: Event) -> None:
        if isinstance(event, Delta) and event.text and self.first_token_ms is None:
            self.first_token_ms = self._since_submit_ms()
        if isinstance(event, (Done, Failed)):
            self.total_ms = self._since_submit_ms()
            self.done.set()
        try:
            self._on_event(event)
        except Exception as e:  # the owner's problem; the batch goes on
            logger.exception(f"serve event callback failed: {e!r}")


@dataclass
class _Row:
    ticket: Ticket
    choice: int
    stream: TextStream
    generator: Optional[torch.Generator]
    position: int  # position id of `last`: where the next decode step feeds it
    last: int = -1  # the token the next decode step feeds
    # the LoRA expert the row was admitted with: a hot-swapped adapter (--feedback-lora) serves the rows admitted
    # after the swap, so each completion is the work of one adapter version
    expert: Optional[LoraExpert] = None
    choices: list[TokenChoice] = field(default_factory=list)  # every sampled token (logprobs), eos excluded

    @property
    def params(self) -> SamplingParams:
        return self.ticket.generation.params

    @property
    def finished(self) -> bool:
        return self.ticket.finish_reasons[self.choice] is not None


class ServeEngine:
    def __init__(self, weights, decode: Callable[[Sequence[int]], str], config: ServeConfig,
                 experts: Optional[ExpertRegistry] = None, eos_token_id: Optional[int] = None,
                 device: torch.device = torch.device("cpu")):
        """`weights`: a node.serve.weights source (step(), load(), max_seq_len); `decode`: token ids -> text;
        `device`: where the model and the KV cache live (sampling, generators and experts stay on the CPU)."""
        self._weights = weights
        self.device = torch.device(device)
        self._decode = decode
        self.config = config
        self.experts = experts if experts is not None else ExpertRegistry()
        self.eos_token_id = eos_token_id
        self.max_seq_len = int(weights.max_seq_len)
        self.vocab_size = int(weights.vocab_size)
        self._cond = threading.Condition()  # guards _waiting, _running_rows, _stopping
        self._waiting: deque[Ticket] = deque()
        self._running_rows = 0
        self._stopping = False
        self._rows: list[_Row] = []  # engine thread only
        self._batch = KVBatch()  # engine thread only, rows in the order of _rows
        self._served: Optional[ServedWeights] = None
        self._default_generator = torch.Generator().manual_seed(secrets.randbits(63))
        self.completed_requests = 0  # requests whose every choice ended (engine thread writes; read for /metrics)
        self.generated_tokens = 0  # tokens sampled for running rows, end-of-text included
        self._token_text: dict[int, str] = {}  # logprob alternatives' texts, filled as seen (bounded by the vocab)
        self._thread = threading.Thread(target=self._run, name="dtrain-serve", daemon=True)

    # ---- owner's interface (any thread)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for ticket in waiting:
            ticket._emit(Failed("the node is shutting down"))

    @property
    def served_step(self) -> Optional[int]:
        served = self._served
        return served.step if served is not None else None

    def node_step(self) -> int:
        """The step the next admitted request will be served at (once the running ones drained)."""
        return self._weights.step()

    def load(self) -> tuple[int, int]:
        """(rows decoding now, requests waiting)."""
        with self._cond:
            return self._running_rows, len(self._waiting)

    def submit(self, generation: Generation, on_event: Callable[[Event], None]) -> Ticket:
        """Queue one request; raises QueueFullError past the queue, EngineStoppedError when not running."""
        self._check(generation)
        ticket = Ticket(generation, on_event)
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise EngineStoppedError("the serving engine is not running")
            room = self.config.max_batch - self._running_rows
            queued = 0  # waiting requests that will not fit into the batch's free rows
            for t in self._waiting:
                if queued == 0 and t.generation.n <= room:
                    room -= t.generation.n
                else:
                    queued += 1
            if not (queued == 0 and generation.n <= room) and queued >= self.config.queue_size:
                raise QueueFullError(f"{self._running_rows} sequences are decoding and {queued} requests are "
                                     f"waiting (the node's limits: --serve-max-batch {self.config.max_batch}, "
                                     f"--serve-queue {self.config.queue_size}); retry later")
            self._waiting.append(ticket)
            self._cond.notify_all()
        return ticket

    def _check(self, g: Generation) -> None:
        # the caller validated all of it against the same bounds; these are the engine's own invariants
        if not g.prompt_ids:
            raise ServeError("a prompt needs at least one token")
        if not 1 <= g.n <= self.config.max_batch:
            raise ServeError(f"n must be in [1, {self.config.max_batch}], got {g.n}")
        if not 1 <= g.params.max_tokens or len(g.prompt_ids) + g.params.max_tokens > self.max_seq_len:
            raise ServeError(f"{len(g.prompt_ids)} prompt tokens + max_tokens {g.params.max_tokens} exceed the "
                             f"model's {self.max_seq_len} positions")
        if g.expert is not None and g.expert not in self.experts:
            raise ServeError(f"no expert {g.expert!r}")

    # ---- the engine thread

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    break
            try:
                self._admit()
                self._retire()  # choices that ended on their first token
                if self._rows:
                    self._decode_step()
                    self._retire()
                else:
                    with self._cond:
                        if not self._waiting and not self._stopping:
                            self._cond.wait(IDLE_WAIT_S)
            except Exception as e:  # log, fail what was running, go on
                logger.exception(f"serve loop failed: {e!r}")
                self._fail_running("the node failed to generate this completion (logged)")
                time.sleep(ERROR_BACKOFF_S)
        self._fail_running("the node is shutting down")

    def _fail_running(self, message: str) -> None:
        tickets = {id(r.ticket): r.ticket for r in self._rows}
        self._rows, self._batch = [], KVBatch()
        with self._cond:
            self._running_rows = 0
        for ticket in tickets.values():
            if not ticket.cancelled and not ticket.done.is_set():
                ticket._emit(Failed(message))

    def _admit(self) -> None:
        if not self._rows:
            served = self._served
            if served is None or self._weights.step() != served.step:
                with self._cond:
                    waiting = bool(self._waiting)
                if not waiting:
                    # idle: no model of an older step is held (its snapshot's bytes go once the node published a
                    # newer one); the next request takes the current step's
                    self._served = None
                    return
                self._served = self._weights.load()
                # in place: a fixed model is the engine's own; the node's shared model is on the device already
                self._served.model.to(self.device)
                logger.info(f"serving model step {self._served.step}")
        elif self._weights.step() != self._served.step:
            return  # let the running rows finish on their step, then load the new one
        while True:
            with self._cond:
                if not self._waiting or len(self._rows) + self._waiting[0].generation.n > self.config.max_batch:
                    return
                ticket = self._waiting.popleft()
                if ticket.cancelled:
                    continue
                if self._rows and self._weights.step() != self._served.step:
                    # a step published before this ticket was taken (the check above may have read the old one):
                    # it waits for the running rows to drain and gets the new step's weights
                    self._waiting.appendleft(ticket)
                    return
                self._running_rows += ticket.generation.n
            self._prefill(ticket)

    def _prefill(self, ticket: Ticket) -> None:
        g, served = ticket.generation, self._served
        expert = self.experts.get(g.expert)  # resolved once: the rows keep this version
        ticket.step = served.step
        ticket.queue_ms = ticket._since_submit_ms()
        cache = DynamicCache()
        with torch.no_grad():
            out = served.model.base_model(input_ids=torch.tensor([g.prompt_ids], dtype=torch.long, device=self.device),
                                          past_key_values=cache, use_cache=True)
            logits = self._logits(served.model, out.last_hidden_state[:, -1], [expert])  # (1, V)
        stop = g.params.stop
        rows = [_Row(ticket, i, TextStream(self._decode, stop, g.strip_leading), row_generator(g.params.seed, i),
                     position=len(g.prompt_ids) - 1, expert=expert) for i in range(g.n)]  # `last`: the prompt's end
        if g.n > 1:
            cache.batch_repeat_interleave(g.n)
            logits = logits.expand(g.n, -1)
        sampled = choose(logits, [g.params] * g.n, [r.generator for r in rows], self._default_generator)
        self._rows.extend(rows)
        self._batch.add(cache, g.n)
        for row, choice in zip(rows, sampled):
            self._advance(row, choice)

    def _decode_step(self) -> None:
        rows, model = self._rows, self._served.model
        mask = self._batch.extended_mask()
        with torch.no_grad():
            out = model.base_model(
                input_ids=torch.tensor([[r.last] for r in rows], dtype=torch.long, device=self.device),  # (B, 1)
                position_ids=torch.tensor([[r.position] for r in rows], dtype=torch.long, device=self.device),
                attention_mask=mask,  # (B, L + 1): left padding hidden
                past_key_values=self._batch.cache,  # grows by one column in place
                use_cache=True,
            )
            logits = self._logits(model, out.last_hidden_state[:, -1], [r.expert for r in rows])
        self._batch.mask = mask
        sampled = choose(logits, [r.params for r in rows], [r.generator for r in rows], self._default_generator)
        for row, choice in zip(rows, sampled):
            if not row.ticket.cancelled:
                self._advance(row, choice)

    def _logits(self, model: PreTrainedModel, hidden: torch.Tensor,
                experts: Sequence[Optional[LoraExpert]]) -> torch.Tensor:
        """(B, V) float32 CPU logits of the final hidden states `hidden` (B, d), each row with its expert's delta
        (experts live on the CPU: a rank-r product)."""
        distinct = {id(e): e for e in experts if e is not None}
        if distinct:
            hidden = hidden.clone()
            for key, expert in distinct.items():
                idx = torch.tensor([i for i, e in enumerate(experts) if id(e) == key], device=hidden.device)
                delta = expert.delta(hidden[idx].to("cpu", torch.float32)).to(hidden.device, hidden.dtype)
                hidden[idx] = hidden[idx] + delta
        return model.get_output_embeddings()(hidden).to("cpu", torch.float32)

    def _advance(self, row: _Row, choice: TokenChoice) -> None:
        """One sampled token of a running row: text, events, and whether the row ends here."""
        ticket, params = row.ticket, row.params
        self.generated_tokens += 1
        if choice.token_id == self.eos_token_id:
            self._end(row, row.stream.finish(), "stop")
            return
        row.choices.append(choice)
        ticket.token_ids[row.choice].append(choice.token_id)
        released = row.stream.push(choice.token_id)
        if released.stopped:
            self._end(row, released, "stop")
        elif len(row.choices) >= params.max_tokens:
            self._send(row, released)
            self._end(row, row.stream.finish(), "length")
        else:
            self._send(row, released)
            row.last = choice.token_id
            row.position += 1

    def _send(self, row: _Row, released) -> None:
        if not released.text and not released.tokens:
            return
        logprobs = ()
        if row.params.logprobs is not None:
            logprobs = tuple(self._token_logprob(row.choices[i], text) for i, text in released.tokens)
        row.ticket.texts[row.choice] += released.text
        row.ticket._emit(Delta(row.choice, released.text, logprobs))

    def _end(self, row: _Row, released, reason: str) -> None:
        self._send(row, released)
        ticket = row.ticket
        ticket.finish_reasons[row.choice] = reason
        with self._cond:  # the row decodes no more: `load` says so before its client hears it ended (_retire drops it)
            self._running_rows -= 1
        ticket._emit(Finish(row.choice, reason))
        if all(r is not None for r in ticket.finish_reasons):
            self.completed_requests += 1
            ticket._emit(Done())

    def _token_logprob(self, choice: TokenChoice, text: str) -> TokenLogprob:
        top = tuple((self._text_of(t), t, lp) for t, lp in choice.top)
        return TokenLogprob(text, choice.token_id, choice.logprob, top)

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._decode([token_id])
        return text

    def _retire(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if not r.finished and not r.ticket.cancelled]
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        self._batch.keep(keep)
        with self._cond:
            self._running_rows = len(self._rows)
