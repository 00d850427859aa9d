"""The node's serving options (`dtrain-node` flags in the "serving" group): the OpenAI-compatible API, the capture
of what it serves (off unless the operator names a file) and the feedback that trains on it."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from dtrain.node.options import option


@dataclass(frozen=True)
class ServeConfig:
    """Bounds of the /v1 API and the decode loop behind it; every number a request sends is capped by one of these."""

    max_tokens: int = option(128, "--serve-max-tokens", "largest max_tokens of one request (also bounded by the "
                                                         "model's context length)")
    max_n: int = option(4, "--serve-max-n", "largest n (choices) of one request")
    max_batch: int = option(32, "--serve-max-batch", "sequences decoded together in the running batch")
    queue_size: int = option(64, "--serve-queue", "requests waiting for room in the running batch; past it 429")
    capture_db: Optional[str] = option(None, "--capture-db", "record every /v1 completion (prompt, completion, "
                                       "token ids, step, timing) and its rewards in this SQLite file, created at the "
                                       "first one; without it nothing served is kept and no feedback is taken",
                                       metavar="PATH")
    capture_max_rows: int = option(100_000, "--capture-max-rows", "completions kept in the capture db; the oldest "
                                                                  "are dropped beyond it")
    feedback_train: bool = option(False, "--feedback-train", "turn rewarded completions into training "
                                  "contributions of the shared model", without="rewards are recorded and train "
                                  "nothing, unless --feedback-lora trains an adapter on them",
                                  action="store_true", dest="feedback_train")
    feedback_interval_s: float = option(10.0, "--feedback-interval", "seconds between feedback contributions")
    feedback_batch: int = option(16, "--feedback-batch", "rewarded completions per feedback contribution")
    feedback_lora: Optional[str] = option(None, "--feedback-lora", "train the LoRA adapter NAME on rewarded "
                                          "completions instead of the shared model, averaged with the nodes that "
                                          "train the same NAME; served as model=NAME", metavar="NAME")
    feedback_lora_rank: int = option(8, "--feedback-lora-rank", "rank r of the --feedback-lora adapter")
    feedback_lora_lr: float = option(1e-2, "--feedback-lora-lr", "AdamW learning rate of the --feedback-lora adapter")
    feedback_lora_target: int = option(16, "--feedback-lora-target", "rewarded completions the adapter's nodes "
                                       "gather together before an update (or fewer, once they stop growing)")
    max_prompt_chars: int = 200_000  # longest prompt (or all messages together) before tokenizing, characters
    max_stop: int = 4  # stop sequences per request (OpenAI's limit)
    max_stop_chars: int = 64  # longest stop sequence, characters
    max_logprobs: int = 5  # top alternatives per token (`logprobs` of completions, `top_logprobs` of chat)
    request_timeout_s: float = 300.0  # bound on one request from submission to its last token, seconds
    max_body_bytes: int = 2 * 1024 * 1024  # largest /v1 request body

    def __post_init__(self):
        for name in ("max_tokens", "max_n", "max_batch", "capture_max_rows", "feedback_batch", "max_prompt_chars",
                     "feedback_lora_rank", "feedback_lora_target"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"serve: {name} must be a positive integer, got {value!r}")
        if isinstance(self.queue_size, bool) or not isinstance(self.queue_size, int) or self.queue_size < 0:
            raise ValueError(f"serve: queue_size must be an integer >= 0, got {self.queue_size!r}")
        if self.max_n > self.max_batch:
            raise ValueError(f"serve: max_n ({self.max_n}) cannot exceed max_batch ({self.max_batch}): "
                             "a request's choices decode in one batch")
        for name in ("feedback_interval_s", "request_timeout_s", "feedback_lora_lr"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"serve: {name} must be > 0 seconds, got {value!r}")
        if self.capture_db is not None and (not isinstance(self.capture_db, str) or not self.capture_db.strip()):
            raise ValueError(f"serve: --capture-db must be a file path, got {self.capture_db!r}")
        if self.feedback_train and not self.capture:
            raise ValueError("serve: --feedback-train trains on recorded completions; it needs --capture-db PATH")
        if self.feedback_lora is not None:
            check_adapter_name(self.feedback_lora)
            if self.feedback_train:
                raise ValueError("serve: --feedback-train trains the shared model and --feedback-lora an adapter "
                                 "instead of it; choose one")
            if not self.capture:
                raise ValueError("serve: --feedback-lora trains on recorded completions; it needs --capture-db PATH")

    @property
    def capture(self) -> bool:
        """The operator chose to record what is served (and so to take feedback on it)."""
        return self.capture_db is not None


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_adapter_name(name: object) -> str:
    """A LoRA adapter's name: what clients send as `model` and part of its hivemind run id (`<run_id>_lora_<name>`)."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"serve: adapter name must be 1-64 characters of letters, digits, '_', '.' or '-', "
                         f"starting with a letter or digit; got {name!r}")
    return name
