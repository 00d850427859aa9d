"""Token ids to streamed text: incremental detokenization with stop sequences (pure, no model).

A choice's text is released token by token, but never ahead of what is certain:
- a suffix that could still become a stop sequence is held back until the next token settles it;
- a token that ends inside a multi-byte UTF-8 character (GPT-2's byte-level BPE splits them) is held back until
  the character is complete (the decoder shows the incomplete bytes as U+FFFD).
When a stop sequence appears, the text ends right before it; the stop sequence itself is never sent. Released
tokens carry their span of the text, so logprobs line up with the text the client received.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Released:
    """What one push released: new text, and the tokens behind it (index into the pushed tokens, text span)."""

    text: str
    tokens: tuple[tuple[int, str], ...]  # (index of the pushed token, its text as released)
    stopped: bool = False  # a stop sequence ended the text


class TextStream:
    """The text of one choice as its tokens arrive; `push` each token, then `finish` when generation ends."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), strip_leading: bool = False):
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._strip = strip_leading  # drop leading whitespace (chat: the model answers " Four" after "Assistant:")
        self._ids: list[int] = []
        self._skip = 0  # characters of leading whitespace dropped from the decoded text
        self._sent = 0  # characters of the (stripped) text released
        self._sent_tokens = 0  # tokens released
        self.text = ""  # everything released so far
        self.done = False

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def push(self, token_id: int) -> Released:
        if self.done:
            raise RuntimeError("push after the stream ended")
        self._ids.append(int(token_id))
        text = self._full()
        found = self._find_stop(text)
        if found is not None:
            self.done = True
            return self._release(text, max(found, self._sent), stopped=True)
        end = len(text)
        while end > self._sent and text[end - 1] == REPLACEMENT:
            end -= 1  # an incomplete character: wait for its other bytes
        end -= self._held_stop_prefix(text[:end])
        return self._release(text, max(end, self._sent))

    def finish(self) -> Released:
        """Generation ended (end of text or length): release everything held back."""
        self.done = True
        text = self._full()
        return self._release(text, len(text))

    # ---- internals

    def _full(self) -> str:
        text = self._decode(self._ids)
        if self._strip:
            if self._sent == 0:
                stripped = text.lstrip()
                self._skip = len(text) - len(stripped)
            return text[self._skip:]
        return text

    def _find_stop(self, text: str) -> Optional[int]:
        if not self._stop:
            return None
        start = max(0, self._sent - self._max_stop + 1)  # released text holds no stop: a new one ends after it
        hits = [i for s in self._stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_stop_prefix(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some stop sequence (and is not yet one)."""
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text) - self._sent), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _release(self, text: str, end: int, stopped: bool = False) -> Released:
        new_text = text[self._sent:end]
        tokens = []
        # a token is released once the text through its last character is (the token that completes a stop
        # sequence is released with the part of its text before the stop)
        for i in range(self._sent_tokens, len(self._ids)):
            token_end = len(self._prefix_text(i + 1))
            token_start = len(self._prefix_text(i))
            if stopped:
                if token_start >= end:
                    break
            elif token_end > end:
                break
            tokens.append((i, text[min(token_start, end):min(token_end, end)]))
        self._sent_tokens += len(tokens)
        self._sent = end
        self.text += new_text
        return Released(new_text, tuple(tokens), stopped)

    def _prefix_text(self, n: int) -> str:
        text = self._decode(self._ids[:n])
        if self._strip:
            return text[self._skip:] if len(text) >= self._skip else ""
        return text
