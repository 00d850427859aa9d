"""Reference split-inference client: the phone's half of the protocol, in Python.

The client downloads the model's embedding matrix once (f16 by default; tied with the LM head), looks
up token embeddings locally, sends only those vectors to the node, and computes logits
(`pre_activations @ wte^T`, float32) and samples locally. Token ids, logits and the chosen tokens never
leave the client. It is NOT private against the node by default: an un-noised embedding row identifies
its token exactly (nearest neighbour over wte). `noise_sigma` adds the protocol's client-side Gaussian
noise (step 5); see docs/split-privacy.md for what each setting recovers and what it costs.

Transport: a WebSocket to `/api/v1/split/stream`, falling back to `POST /api/v1/split/forward` when the
socket cannot be opened or breaks (the node keeps the session's cache either way).

`AsyncSplitClient` is the asyncio API; `SplitClient` wraps it for synchronous code with a private loop.
"""
from __future__ import annotations

import asyncio
import base64
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import aiohttp
import numpy as np
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

RESTART_CODES = ("stale_session", "no_session")  # the node lost or refused the session: resend everything


class SplitClientError(RuntimeError):
    """The node answered a request with an error (its message and code are kept)."""

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # nucleus: smallest set of tokens with cumulative probability >= top_p
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the sequence (CTRL / HF style)


def apply_repetition_penalty(logits: np.ndarray, seen: Sequence[int], penalty: float) -> np.ndarray:
    if penalty == 1.0 or not len(seen):
        return logits
    logits = logits.copy()
    ids = np.unique(np.asarray(seen, dtype=np.int64))
    picked = logits[ids]
    logits[ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def sample(logits: np.ndarray, sampling: SamplingConfig, rng: np.random.Generator, seen: Sequence[int] = ()) -> int:
    """One token id from float32 logits [V] (greedy when temperature is 0)."""
    logits = apply_repetition_penalty(np.asarray(logits, dtype=np.float32), seen, sampling.repetition_penalty)
    if sampling.temperature <= 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / sampling.temperature
    order = np.argsort(-scaled, kind="stable")  # most likely first
    if sampling.top_k > 0:
        order = order[: sampling.top_k]
    top = scaled[order]
    probs = np.exp(top - top.max())
    probs /= probs.sum()
    if sampling.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), sampling.top_p) + 1)  # first index reaching top_p, inclusive
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])


def encode_hidden(hidden: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(hidden, dtype="<f4").tobytes()).decode("ascii")


def decode_pre_activations(answer: dict, hidden_dim: int) -> np.ndarray:
    raw = base64.b64decode(answer["pre_activations"], validate=True)
    if len(raw) % (4 * hidden_dim):
        raise SplitClientError(f"pre_activations of {len(raw)} bytes is not a whole number of {hidden_dim}-float rows")
    return np.frombuffer(raw, dtype="<f4").reshape(-1, hidden_dim).astype(np.float32)


class AsyncSplitClient:
    def __init__(self, node_url: str, *, transport: str = "auto", weights_format: str = "f16",
                 noise_sigma: float = 0.0, expert_name: Optional[str] = None, use_he: bool = False,
                 timeout_s: float = 60.0, seed: Optional[int] = None):
        if transport not in ("auto", "ws", "http"):
            raise ValueError(f"transport must be auto, ws or http, got {transport!r}")
        if weights_format not in ("f16", "f32"):
            raise ValueError(f"weights_format must be f16 or f32, got {weights_format!r}")
        if noise_sigma < 0:
            raise ValueError(f"noise_sigma must be >= 0, got {noise_sigma!r}")
        self.node_url = node_url.rstrip("/")
        self.transport = transport
        self.weights_format = weights_format
        self.noise_sigma = float(noise_sigma)  # client-side Gaussian noise on every embedding sent (protocol step 5)
        self.expert_name = expert_name
        self.use_he = use_he
        self.timeout_s = timeout_s
        self.rng = np.random.default_rng(seed)
        self.config: dict = {}
        self.wte: Optional[np.ndarray] = None  # [V, d] float32 embedding
        self.lm_head: Optional[np.ndarray] = None  # [V, d] float32; the same array when tied
        self.weights_step: Optional[int] = None
        self.last_answer: dict = {}  # the node's last forward answer (timings, dp_sigma, ...)
        self._http: Optional[aiohttp.ClientSession] = None
        self._ws: Optional[aiohttp.ClientWebSocketResponse] = None
        self._ws_lock = asyncio.Lock()  # one request in flight per socket: answers come back in order

    # ---- lifecycle

    async def connect(self) -> "AsyncSplitClient":
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        if self.transport in ("auto", "ws"):
            try:
                self._ws = await asyncio.wait_for(
                    self._http.ws_connect(self.node_url + "/api/v1/split/stream", max_msg_size=0), self.timeout_s)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                if self.transport == "ws":
                    raise
                logger.info("split WebSocket unavailable (%r); using HTTP", e)
        self.config = await self.request({"type": "config"})
        await self.load_weights()
        return self

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
            self._ws = None
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> "AsyncSplitClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def using_websocket(self) -> bool:
        return self._ws is not None and not self._ws.closed

    async def load_weights(self) -> None:
        """(Re)download the embedding (and an untied LM head) named by the node's config."""
        cfg = self.config
        V, d = cfg["vocab_size"], cfg["hidden_size"]
        self.wte, step = await self._download(cfg["embedding_url"], V, d)
        if cfg.get("tied_lm_head", True):
            self.lm_head = self.wte
        else:
            self.lm_head, _ = await self._download(cfg["lm_head_url"], V, d)
        self.weights_step = step

    async def _download(self, path: str, V: int, d: int) -> tuple[np.ndarray, Optional[int]]:
        url = f"{self.node_url}{path}?format={self.weights_format}"
        async with self._http.get(url) as r:
            if r.status != 200:
                raise SplitClientError(f"GET {path}: HTTP {r.status}: {await r.text()}")
            body = await r.read()
            step = r.headers.get("X-Model-Step")
        dtype = "<f2" if self.weights_format == "f16" else "<f4"
        want = V * d * np.dtype(dtype).itemsize
        if len(body) != want:
            raise SplitClientError(f"GET {path}: {len(body)} bytes, expected {want} for [{V}, {d}] {self.weights_format}")
        return np.frombuffer(body, dtype=dtype).reshape(V, d).astype(np.float32), (int(step) if step else None)

    # ---- the protocol

    async def request(self, message: dict) -> dict:
        """Send one protocol message (WebSocket if open, else HTTP); raise SplitClientError on an error answer."""
        answer = None
        if self.using_websocket:
            try:
                async with self._ws_lock:
                    await asyncio.wait_for(self._ws.send_json(message), self.timeout_s)
                    msg = await self._ws.receive(timeout=self.timeout_s)
                if msg.type == aiohttp.WSMsgType.TEXT:
                    answer = msg.json()
                else:
                    raise ConnectionError(f"socket answered {msg.type.name}")
            except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as e:
                if self.transport == "ws":
                    raise
                logger.warning("split WebSocket failed (%r); falling back to HTTP", e)
                await self._ws.close()
                self._ws = None
        if answer is None:
            answer = await self._http_request(message)
        if answer.get("type") == "error":
            raise SplitClientError(answer.get("message", "error"), answer.get("code"))
        return answer

    async def _http_request(self, message: dict) -> dict:
        kind = message.get("type")
        if kind == "config":
            async with self._http.get(self.node_url + "/api/v1/split/config") as r:
                return await self._http_answer(r)
        if kind == "ping":
            return {"type": "pong"}
        route = {"forward": "/api/v1/split/forward", "tokenize": "/api/v1/split/tokenize"}.get(kind)
        if route is None:
            raise SplitClientError(f"no HTTP route for message type {kind!r}")
        async with self._http.post(self.node_url + route, json=message) as r:
            return await self._http_answer(r)

    @staticmethod
    async def _http_answer(r: aiohttp.ClientResponse) -> dict:
        body = await r.json(content_type=None)
        if r.status != 200:
            return {"type": "error", "message": body.get("message", f"HTTP {r.status}"), "code": body.get("code")}
        return body

    async def tokenize(self, text: str) -> list[int]:
        return (await self.request({"type": "tokenize", "text": text}))["token_ids"]

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        """[T, d] float32 embeddings, plus the client-side noise when `noise_sigma` > 0."""
        hidden = self.wte[np.asarray(token_ids, dtype=np.int64)]
        if self.noise_sigma > 0:
            hidden = hidden + self.rng.normal(0.0, self.noise_sigma, size=hidden.shape).astype(np.float32)
        return hidden.astype(np.float32)

    def logits(self, pre_activations: np.ndarray) -> np.ndarray:
        return pre_activations @ self.lm_head.T  # (T, V) float32

    async def forward(self, hidden: np.ndarray, session_id: Optional[str] = None, incremental: bool = False) -> np.ndarray:
        """pre_activations [T, d] for embeddings `hidden` [T, d]."""
        T, d = hidden.shape
        answer = await self.request({
            "type": "forward", "hidden_states": encode_hidden(hidden), "seq_len": T, "hidden_dim": d,
            "expert_name": self.expert_name, "use_he": self.use_he,
            "session_id": session_id, "incremental": incremental,
        })
        self.last_answer = answer
        return decode_pre_activations(answer, d)

    async def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 32,
                       sampling: SamplingConfig = SamplingConfig(), incremental: bool = True,
                       stop_token_ids: Sequence[int] = ()) -> list[int]:
        """The new token ids after `prompt` (text is tokenized by the node)."""
        ids = await self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt has no tokens")
        max_len = self.config["max_seq_len"]
        new: list[int] = []
        session_id = uuid.uuid4().hex if incremental else None
        sent = 0  # positions the node holds for this session
        while len(new) < max_new_tokens and len(ids) <= max_len:  # the node holds at most max_len positions
            if incremental and sent:
                try:
                    pre = await self.forward(self.embed(ids[sent:]), session_id, incremental=True)
                except SplitClientError as e:
                    if e.code not in RESTART_CODES:
                        raise
                    # the model moved (or the cache expired): fresh weights, then the whole sequence again
                    logger.info("restarting split session: %s", e)
                    await self.load_weights()
                    pre = await self.forward(self.embed(ids), session_id, incremental=False)
            else:
                pre = await self.forward(self.embed(ids), session_id, incremental=False)
            sent = len(ids)
            token = sample(self.logits(pre[-1:])[0], sampling, self.rng, ids)
            new.append(token)
            ids.append(token)
            if token in stop_token_ids:
                break
        return new


class SplitClient:
    """Synchronous façade over AsyncSplitClient (runs its own event loop; not for use inside a running loop)."""

    def __init__(self, node_url: str, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._client = AsyncSplitClient(node_url, **kwargs)
        self._run(self._client.connect())

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    def __getattr__(self, name: str):
        return getattr(self._client, name)  # config, wte, lm_head, embed, logits, last_answer, ...

    def request(self, message: dict) -> dict:
        return self._run(self._client.request(message))

    def tokenize(self, text: str) -> list[int]:
        return self._run(self._client.tokenize(text))

    def forward(self, hidden: np.ndarray, session_id: Optional[str] = None, incremental: bool = False) -> np.ndarray:
        return self._run(self._client.forward(hidden, session_id, incremental))

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 32, **kwargs: Any) -> list[int]:
        sampling = kwargs.pop("sampling", None) or SamplingConfig(**{
            k: kwargs.pop(k) for k in ("temperature", "top_k", "top_p", "repetition_penalty") if k in kwargs})
        return self._run(self._client.generate(prompt, max_new_tokens, sampling=sampling, **kwargs))

    def load_weights(self) -> None:
        self._run(self._client.load_weights())

    def close(self) -> None:
        try:
            self._run(self._client.close())
        finally:
            self._loop.close()

    def __enter__(self) -> "SplitClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
