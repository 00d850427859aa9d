"""Choosing the next token of each row of a decode batch, and the logprobs reported for it (pure torch).

- `temperature == 0` is greedy (argmax); otherwise the logits are divided by the temperature, and with
  `top_p < 1` only the smallest set of most likely tokens whose probability reaches `top_p` is kept (nucleus
  sampling; the most likely token is always kept).
- A row with a `seed` draws from its own generator, seeded once per choice (choice i of a request with seed s
  uses s + i), so the same request with the same seed on the same weights gives the same text.
- Logprobs are those of the model's own distribution (log-softmax of the raw logits, before temperature and
  top_p), as OpenAI reports them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request's choices are sampled; every number was bounded by whoever built it."""

    max_tokens: int  # tokens to generate at most, per choice
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: Optional[int] = None  # per-request seed; None: the engine's own randomness
    stop: tuple[str, ...] = ()  # stop sequences: the text ends before the first one
    logprobs: Optional[int] = None  # None: no logprobs; k: the chosen token's logprob and the k most likely


@dataclass(frozen=True)
class TokenChoice:
    token_id: int
    logprob: Optional[float]  # of the chosen token (None when not asked)
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the k most likely tokens


def row_generator(seed: Optional[int], choice: int) -> Optional[torch.Generator]:
    if seed is None:
        return None
    return torch.Generator().manual_seed((int(seed) + choice) % (1 << 63))


def choose(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]],
           default: torch.Generator) -> list[TokenChoice]:
    """The next token of every row of `logits` [B, V] (float32)."""
    B = logits.shape[0]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)  # (B,)
    sampled = temps > 0
    chosen = logits.argmax(dim=-1)  # (B,) greedy rows keep this
    if bool(sampled.any()):
        idx = sampled.nonzero().flatten()
        probs = torch.softmax(logits[idx] / temps[idx, None], dim=-1)  # (b, V)
        for j, row in enumerate(idx.tolist()):
            p = params[row]
            row_probs = probs[j]
            if p.top_p < 1.0:
                row_probs = _nucleus(row_probs, p.top_p)
            g = generators[row] if generators[row] is not None else default
            chosen[row] = torch.multinomial(row_probs, 1, generator=g)[0]
    want = [p.logprobs is not None for p in params]
    logprobs = torch.log_softmax(logits[torch.tensor(want)], dim=-1) if any(want) else None
    out, k = [], 0
    for row in range(B):
        token = int(chosen[row])
        if not want[row]:
            out.append(TokenChoice(token, None, ()))
            continue
        lp = logprobs[k]
        k += 1
        top = ()
        if params[row].logprobs:
            values, ids = lp.topk(params[row].logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        out.append(TokenChoice(token, float(lp[token]), top))
    return out


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` [V] with only the smallest most-likely set of mass >= top_p kept (unnormalized: multinomial
    normalizes)."""
    sorted_p, order = probs.sort(descending=True)
    before = sorted_p.cumsum(0) - sorted_p  # mass of the tokens more likely than each
    sorted_p[before >= top_p] = 0.0  # the first token has 0 before it: always kept
    return torch.zeros_like(probs).scatter_(0, order, sorted_p)
