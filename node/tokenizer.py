"""The GPT-2 byte-level BPE tokenizer, built from static/vocab.json and static/merges.txt."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def load_tokenizer(static_dir: str | Path) -> Tokenizer:
    static_dir = Path(static_dir)
    vocab = json.loads((static_dir / "vocab.json").read_text(encoding="utf-8"))
    merges = []
    for line in (static_dir / "merges.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#version"):
            left, right = line.split(" ")
            merges.append((left, right))
    # passing vocab/merges objects (not file names): transformers 5.x silently builds an empty tokenizer from files
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
