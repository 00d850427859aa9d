"""Local text data: tokenized once, served as random token windows."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hivemind.utils.logging import get_logger

logger = get_logger(__name__)


class DataError(ValueError):
    pass


class TokenDataset:
    """A text file tokenized into one uint32 stream; batches are random windows of it."""

    def __init__(self, tokens: np.ndarray, source: str = "<memory>"):
        self.tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        self.source = source

    @classmethod
    def from_text_file(cls, path: str | Path, tokenizer) -> "TokenDataset":
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        text = path.read_text(encoding="utf-8", errors="replace")
        logger.info(f"Tokenizing {path} ({len(text):,} characters)")
        ids = tokenizer.encode(text).ids
        logger.info(f"{path}: {len(ids):,} tokens")
        return cls(np.asarray(ids, dtype=np.uint32), str(path))

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, batch_size: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
        """[batch_size, seq_len] uint32 windows; a model trains on them with labels = inputs."""
        if batch_size < 1 or seq_len < 2:
            raise DataError(f"batch_size must be >= 1 and seq_len >= 2, got {batch_size} and {seq_len}")
        if len(self.tokens) < seq_len:
            raise DataError(f"dataset has {len(self.tokens)} tokens, fewer than seq_len {seq_len}")
        starts = rng.integers(0, len(self.tokens) - seq_len + 1, size=batch_size)
        return self.tokens[starts[:, None] + np.arange(seq_len)[None, :]]
