"""Parity between the browser tokenizer (dtrain/static/tokenizer.js, run under Node) and the Python one."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dtrain.node.assets import gpt2_tokenizer_files
from dtrain.node.tokenizer import load_tokenizer
from tests.texts import shakespeare

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
STATIC = REPO / "dtrain" / "static"
SCRIPT = REPO / "tests" / "js" / "tokenizer_parity.mjs"

STRESS_TEXT = (
    "Hello, world! don't I'll we've they're she's it'd you'm O'Neil 'tis\n"
    "DON'T WE'VE  I'LL\n"
    "Numbers: 3.14159 1,000,000 -42 +7e10 0x1F 2024-01-31 12:30:45 ½ ² ٣٤٥ 一二三\n"
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 👩🏿‍💻 🇺🇸🇯🇵🇩🇪 ❤️ ✌︎ 🫠\n"
    "CJK: 你好，世界！日本語のテキスト。한국어 텍스트\n"
    "Combining: e\u0301 n\u0303 a\u0308\u0304 Z\u0351\u0348\u033a\u0329 café naïve Ångström\n"
    "Arabic: مرحبا بالعالم، كيف حالك؟ Hebrew: שלום עולם\n"
    "Devanagari: नमस्ते दुनिया  Thai: สวัสดีชาวโลก\n"
    "Spaces:    four   three  two end\n"
    "\n\n\nthree newlines above\t\ttabs\t here \t \t mixed\r\nwindows line\r\n"
    "Punctuation runs: !!!??? ...,,, --- ~~~ @#$%^&*() [[{{<<>>}}]] \"quoted\" «guillemets» — – …\n"
    "Code: def f(x): return x**2 // 3  # comment; a != b && c || d -> e => f\n"
    "URL: https://example.com/path?q=1&r=two#frag user@example.org\n"
    "Mixed: abc123def ABC_def-ghi.jkl 1st 2nd 3rd x=1;y=2\n"
    "Lone marks: \u0301 \u200d \u200b \ufe0f zero-width\u200bjoined\n"
    "Trailing spaces and newline:   \n"
    "  leading spaces line\n"
    "end with spaces   "
)


def _node() -> str:
    node = shutil.which("node") or "/usr/bin/node"
    assert Path(node).exists(), "node binary not found"
    return node


@pytest.fixture(scope="module")
def py_tokenizer():
    return load_tokenizer()


def _run_js(text_path: Path, out_path: Path) -> dict:
    files = gpt2_tokenizer_files()
    proc = subprocess.run(
        [_node(), str(SCRIPT), str(STATIC / "tokenizer.js"), str(files.vocab), str(files.merges), str(text_path),
         str(out_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, f"node failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out_path.read_text(encoding="utf-8"))


def _check(text: str, text_path: Path, tmp_path: Path, py_tokenizer, label: str) -> None:
    result = _run_js(text_path, tmp_path / f"{label}.json")
    expected = py_tokenizer.encode(text).ids
    js_ids = result["ids"]
    if js_ids != expected:
        first = next((i for i, (a, b) in enumerate(zip(js_ids, expected)) if a != b), min(len(js_ids), len(expected)))
        pytest.fail(
            f"{label}: JS/Python ids differ at token {first} (js {len(js_ids)} tokens, py {len(expected)}): "
            f"js={js_ids[max(0, first - 3):first + 5]} py={expected[max(0, first - 3):first + 5]}"
        )
    assert result["roundtrip"] is True, f"{label}: decode(encode(text)) != text in JS"
    print(f"{label}: compared {len(expected)} tokens, identical; JS roundtrip exact")


@pytest.mark.slow
def test_shakespeare_parity(tmp_path, py_tokenizer):
    text = shakespeare(1_115_394)  # as many characters as tinyshakespeare
    path = tmp_path / "shakespeare.txt"
    path.write_bytes(text.encode("utf-8"))  # exact bytes: no newline translation
    _check(text, path, tmp_path, py_tokenizer, "shakespeare")


def test_stress_text_parity(tmp_path, py_tokenizer):
    path = tmp_path / "stress.txt"
    path.write_bytes(STRESS_TEXT.encode("utf-8"))  # exact bytes: no newline translation
    _check(STRESS_TEXT, path, tmp_path, py_tokenizer, "stress")
