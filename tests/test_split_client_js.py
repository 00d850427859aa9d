"""static/split_client.js (run under Node, HTTP transport) against a real node: greedy ids equal the
Python reference client's (clients.split_client.SplitClient), token for token."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dtrain.clients.split_client import SplitClient
from tests.inproc import InProcessNode
from tests.nodeproc import TINY_CONFIG, new_run_id

pytestmark = pytest.mark.http

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "js" / "split_greedy.mjs"
PROMPT = [464, 2068, 7586, 21831, 18045, 625]
N = 8


def _node() -> str:
    exe = shutil.which("node") or ("/usr/bin/node" if Path("/usr/bin/node").exists() else None)
    if exe is None:
        pytest.skip("node (Node.js) is not installed")
    return exe


@pytest.fixture(scope="module")
def node():
    proc = InProcessNode("split-js", ["--model-config", str(TINY_CONFIG)], new_run_id())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


def run_js(url: str, prompt: list[int], n: int, penalty: float, out: Path) -> dict:
    r = subprocess.run([_node(), str(SCRIPT), url, json.dumps(prompt), str(n), str(out), str(penalty)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_js_greedy_matches_python_client(node, tmp_path, penalty):
    with SplitClient(node.url, transport="http", weights_format="f16") as client:
        want = client.generate(PROMPT, N, repetition_penalty=penalty)
    got = run_js(node.url, PROMPT, N, penalty, tmp_path / "out.json")
    assert len(want) == N
    assert got["ids"] == want
    last = got["last"]
    assert last["type"] == "forward" and last["incremental"] is True
    assert last["cached_seq_len"] == len(PROMPT) + N - 2  # positions held before the last token was sent


def test_chat_page_and_client_module_are_served(node):
    import urllib.request
    with urllib.request.urlopen(node.url + "/chat", timeout=5) as r:
        page = r.read().decode()
        assert r.status == 200 and "text/html" in r.headers["Content-Type"]
    assert "/static/split_client.js" in page and "/static/tokenizer.js" in page
    with urllib.request.urlopen(node.url + "/static/split_client.js", timeout=5) as r:
        assert "javascript" in r.headers["Content-Type"]
        assert b"export class SplitClient" in r.read()
