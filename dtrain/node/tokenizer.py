"""The GPT-2 byte-level BPE tokenizer, built from a vocab.json and merges.txt (`assets.tokenizer_files`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dtrain.node.assets import TokenizerFiles, tokenizer_files


def load_tokenizer(source: Optional[str | Path | TokenizerFiles] = None) -> Tokenizer:
    """From a folder holding vocab.json and merges.txt, or the files themselves; GPT-2's by default."""
    files = source if isinstance(source, TokenizerFiles) else tokenizer_files(source)
    vocab = json.loads(files.vocab.read_text(encoding="utf-8"))
    merges = []
    for line in files.merges.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#version"):
            left, right = line.split(" ")
            merges.append((left, right))
    # passing vocab/merges objects (not file names): transformers 5.x silently builds an empty tokenizer from files
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
