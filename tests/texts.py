"""Text the tests train on and tokenize: the package's default corpus, decoded. Nothing outside the repository."""
from __future__ import annotations

import functools
from pathlib import Path

from dtrain.node.corpus import default_text


@functools.lru_cache(maxsize=1)
def _corpus() -> str:
    return default_text()


def shakespeare(chars: int) -> str:
    """The first `chars` characters of the default corpus (Shakespeare's plays, 5 MB in all)."""
    return _corpus()[:chars]


def write_shakespeare(path: Path, chars: int) -> Path:
    """A text file of the corpus's first `chars` characters (what `--train-data` and `--data` read)."""
    path.write_text(shakespeare(chars), encoding="utf-8")
    return path
