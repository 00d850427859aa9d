"""GET /api/v1/data/batch over real HTTP: token windows of the node's own dataset for contributors without data
(the node without a dataset answers 404, in test_bridge_http.py)."""
from __future__ import annotations

import numpy as np
import pytest

from node.data import TokenDataset
from node.tokenizer import load_tokenizer
from tests.nodeproc import REPO, TINY_CONFIG
from tests.test_bridge_http import _start, assert_error, assert_plain_response, request

pytestmark = pytest.mark.timeout(240)

TRAIN_TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(TRAIN_TEXT.read_text()[:20_000])
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
    stream = TokenDataset.from_text_file(data_file, load_tokenizer(REPO / "static")).tokens  # as the node has it
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
