"""The default corpus: Project Gutenberg's licence text stripped, and the packaged tokens match their pins."""
from __future__ import annotations

import hashlib
import lzma

import numpy as np
import pytest

from dtrain.node import corpus
from dtrain.node.tokenizer import load_tokenizer

pytestmark = pytest.mark.unit

PLAY = "ACT I.\n\nScene I. A heath.\n\nFirst Witch.\nWhen shall we three meet again?\n"


def test_strip_gutenberg_1990s_header_and_newer_footer():
    text = ("The Project Gutenberg Etext of Macbeth\r\nCopyright laws are changing all over the world\r\n"
            "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\r\n\r\n" + PLAY.replace("\n", "\r\n")
            + "\r\n*** END OF THE PROJECT GUTENBERG EBOOK MACBETH ***\r\nSection 5. General Information\r\n")
    assert corpus.strip_gutenberg(text) == PLAY


def test_strip_gutenberg_start_marker_and_plain_text():
    text = "Produced by volunteers\n*** START OF THIS PROJECT GUTENBERG EBOOK MACBETH ***\n\n\n" + PLAY
    assert corpus.strip_gutenberg(text) == PLAY
    assert corpus.strip_gutenberg(PLAY) == PLAY  # the sdist's texts come already cleaned: nothing to cut


def test_strip_gutenberg_refuses_leftover_licence_text():
    with pytest.raises(corpus.CorpusError, match="play.txt:2: Project Gutenberg"):
        corpus.strip_gutenberg(PLAY[:6] + "\nThis is a Project Gutenberg etext\n", "play.txt")


def test_packaged_tokens_are_the_pinned_text():
    text = corpus.default_text().encode("utf-8")
    assert hashlib.sha256(text).hexdigest() == corpus.TEXT_SHA256  # GPT-2's BPE is lossless: the tokens are the text
    assert text.startswith(b"ALL'S WELL THAT ENDS WELL\n") and b"gutenberg" not in text.lower()
    tokens = corpus.default_tokens()
    assert len(text) > 5_000_000 and len(tokens) > 1_500_000 and tokens.dtype == np.uint32
    assert int(tokens.max()) < corpus.VOCAB_SIZE


def test_token_file_is_the_text_tokenized():
    tokens = corpus.default_tokens()
    # the whole text takes seconds to tokenize: its first 20,000 characters, less a few tokens at the cut
    head = load_tokenizer().encode(corpus.default_text()[:20_000]).ids
    assert tokens[:len(head) - 5].tolist() == head[:-5]
    dataset = corpus.load_corpus()
    assert len(dataset) == len(tokens) and dataset.source == corpus.SOURCE
    assert dataset.batch(2, 8, np.random.default_rng(0)).shape == (2, 8)


def test_damaged_token_files_are_refused():
    with pytest.raises(corpus.CorpusError, match="not an xz file"):
        corpus.decode_tokens(b"\x01\x02\x03", "broken.xz")
    other = lzma.compress(np.array([5, 6000], "<u2").tobytes())
    with pytest.raises(corpus.CorpusError, match="is not the pinned"):
        corpus.decode_tokens(other, "other.xz")
