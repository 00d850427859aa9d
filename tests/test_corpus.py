"""The default corpus: Project Gutenberg's licence text stripped, and the files set-up built match their pins."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from node import corpus
from node.tokenizer import load_tokenizer
from tests.nodeproc import REPO

STATIC = REPO / "static"
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


@pytest.fixture(scope="module")
def built():
    if not (STATIC / corpus.TOKENS_NAME).is_file():
        pytest.fail("static/corpus.u32 is missing: run `make setup`")
    return (STATIC / corpus.TEXT_NAME).read_bytes(), np.fromfile(STATIC / corpus.TOKENS_NAME, dtype="<u4")


def test_built_corpus_is_the_pinned_text(built):
    text, tokens = built
    assert hashlib.sha256(text).hexdigest() == corpus.TEXT_SHA256
    assert text.startswith(b"ALL'S WELL THAT ENDS WELL\n") and b"gutenberg" not in text.lower()
    assert len(text) > 5_000_000 and len(tokens) > 1_500_000


def test_token_file_is_the_text_tokenized(built):
    text, tokens = built
    # the whole text takes seconds to tokenize: its first 20,000 characters, less a few tokens at the cut
    head = load_tokenizer(STATIC).encode(text[:20_000].decode()).ids
    assert tokens[:len(head) - 5].tolist() == head[:-5]
    dataset = corpus.load_corpus(STATIC)
    assert len(dataset) == len(tokens) and dataset.source.endswith("corpus.txt")
    assert dataset.batch(2, 8, np.random.default_rng(0)).shape == (2, 8)


def test_load_corpus_without_set_up_or_with_a_damaged_file(tmp_path):
    assert corpus.load_corpus(tmp_path) is None
    (tmp_path / corpus.TOKENS_NAME).write_bytes(b"\x01\x02\x03")
    with pytest.raises(corpus.CorpusError, match="whole number"):
        corpus.load_corpus(tmp_path)
    (tmp_path / corpus.TOKENS_NAME).write_bytes(np.array([5, 60000], "<u4").tobytes())
    with pytest.raises(corpus.CorpusError, match="60000"):
        corpus.load_corpus(tmp_path)
