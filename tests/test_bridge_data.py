"""GET /api/v1/data/batch over real HTTP: token windows of the node's own dataset for contributors without data,
or of the default corpus the package ships, which the node hands out but never trains on (the node started with
--no-data answers 404, in test_bridge_http.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dtrain.node import corpus
from dtrain.node.data import TokenDataset
from dtrain.node.tokenizer import load_tokenizer
from tests.texts import shakespeare
from tests.nodeproc import TINY_CONFIG
from tests.test_bridge_http import (_start, assert_error, assert_plain_response, current_step, request, small_packet,
                                    submit, wait_step)

pytestmark = [pytest.mark.http, pytest.mark.timeout(240)]



@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(shakespeare(20_000))
    return path


@pytest.fixture(scope="module")
def data_node(data_file):
    proc = _start("data", ["--model-config", str(TINY_CONFIG), "--target-batch-size", "1",
                           "--train-data", str(data_file), "--local-batch-size", "1", "--local-seq-len", "16"])
    try:
        yield proc
    finally:
        proc.kill()


def test_data_batch(data_node, data_file):
    stream = TokenDataset.from_text_file(data_file, load_tokenizer()).tokens  # as the node has it
    for query, (bs, seq_len) in (("", (8, 64)), ("?batch_size=3&seq_len=16", (3, 16)),
                                 ("?batch_size=1&seq_len=2", (1, 2))):
        a = request(data_node, "GET", "/api/v1/data/batch" + query)
        assert a.status == 200
        assert_plain_response(a)
        assert a.headers["Content-Type"] == "application/octet-stream"
        assert (int(a.headers["X-Batch-Size"]), int(a.headers["X-Seq-Len"])) == (bs, seq_len)
        assert len(a.body) == bs * seq_len * 4
        tokens = np.frombuffer(a.body, "<u4").reshape(bs, seq_len)
        # every row is a window of the node's dataset
        windows = np.lib.stride_tricks.sliding_window_view(stream, seq_len)
        for row in tokens:
            assert (windows == row).all(axis=1).any(), row


@pytest.mark.parametrize("query, word", [
    ("batch_size=0", "batch_size"), ("batch_size=-1", "batch_size"), ("batch_size=x", "batch_size"),
    ("batch_size=257", "batch_size"), ("seq_len=1", "seq_len"), ("seq_len=65", "seq_len"),
    ("seq_len=abc", "seq_len"), ("seq_len=2.5", "seq_len"),
])
def test_data_batch_400(data_node, query, word):
    assert_error(request(data_node, "GET", "/api/v1/data/batch?" + query), 400, word)


def _assert_windows_of(body: bytes, bs: int, seq_len: int, stream: np.ndarray) -> None:
    tokens = np.frombuffer(body, "<u4").reshape(bs, seq_len)
    windows = np.lib.stride_tricks.sliding_window_view(stream, seq_len)
    for row in tokens:
        assert (windows == row).all(axis=1).any(), row


@pytest.fixture(scope="module")
def corpus_node(tmp_path_factory):
    """Started as `make node` starts it (no data flag), with 2 contributors per update."""
    train = tmp_path_factory.mktemp("corpus") / "train.json"
    train.write_text(json.dumps({"min_nodes_for_update": 2}))
    proc = _start("corpus", ["--model-config", str(TINY_CONFIG), "--target-batch-size", "1",
                             "--train-config", str(train)])
    try:
        yield proc
    finally:
        proc.kill()


@pytest.mark.slow
def test_default_corpus_is_handed_out_but_not_trained_on(corpus_node):
    stream = corpus.default_tokens()
    for _ in range(3):
        a = request(corpus_node, "GET", "/api/v1/data/batch?batch_size=4&seq_len=32")
        assert a.status == 200
        assert_plain_response(a)
        _assert_windows_of(a.body, 4, 32, stream)
    assert "Handing out batches of the default corpus" in corpus_node.output()

    # the node alone makes exactly one update per min_nodes_for_update (2) contributors: none of its own
    assert corpus_node.status()["updates"] == 0
    for update in (1, 2):
        step = current_step(corpus_node)
        for who in ("a", "b"):
            assert submit(corpus_node, small_packet(step, node_id=f"{who}-{update}")).status == 200
        wait_step(corpus_node, step + 1)
    request(corpus_node, "GET", "/api/v1/data/batch")
    status = corpus_node.status()
    assert status["updates"] == 2 and status["contributors"] == 4
    assert len(corpus_node.get_json("/api/v1/server/losses")) == 2
