"""A swarm started from a Hugging Face checkpoint and taken back out, with real node processes: `--init-from` serves
the directory's weights byte for byte and its tokenizer files, a joiner takes the swarm's state whatever it was
started from, and `dtrain-export --node` writes a directory plain transformers loads with the same logits."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from dtrain.node.assets import tokenizer_files
from tests.nodeproc import PER_STEP, REPO, NodeProcess, new_run_id, wait_until
from tests.test_bridge_semantics import download_f32

pytestmark = pytest.mark.swarm

SHAPE = dict(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2, n_inner=64)


def _save(directory, seed: int, vocab_indent=None) -> GPT2LMHeadModel:
    """A random GPT-2 as save_pretrained writes it, with GPT-2's tokenizer; `vocab_indent` re-serializes vocab.json
    (the same tokenizer in other bytes: what the node serves shows whose file it is)."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**SHAPE)).eval()
    model.save_pretrained(directory)
    files = tokenizer_files()
    vocab = json.loads(files.vocab.read_text(encoding="utf-8"))
    (directory / "vocab.json").write_text(json.dumps(vocab, indent=vocab_indent), encoding="utf-8")
    shutil.copyfile(files.merges, directory / "merges.txt")
    return model


def _get(node, path: str) -> bytes:
    with urllib.request.urlopen(node.url + path, timeout=30) as r:
        return r.read()


@pytest.mark.timeout(240)
def test_a_swarm_from_a_checkpoint_serves_it_and_exports_it(tmp_path):
    founder_model = _save(tmp_path / "founder", seed=0, vocab_indent=1)
    _save(tmp_path / "joiner", seed=1)  # the same shape, other weights: a joiner's own start does not count
    run_id = new_run_id()
    nodes = []
    try:
        a = NodeProcess("A", [*PER_STEP, "--init-from", str(tmp_path / "founder"), "--target-batch-size", "1"], run_id)
        nodes.append(a)
        maddrs = a.wait_ready()
        manifest = a.get_json("/api/v1/model/manifest")["tensors"]
        step, arrays = download_f32(a, manifest)
        assert step == 1
        theirs = dict(founder_model.named_parameters())
        for t, got in zip(manifest, arrays):
            assert got.tobytes() == theirs[t["name"]].detach().numpy().tobytes(), t["name"]
        assert _get(a, "/static/vocab.json") == (tmp_path / "founder" / "vocab.json").read_bytes()
        config = a.get_json("/static/model_config.json")
        assert (config["d_model"], config["n_layers"], config["d_ff"], config["name"]) == (32, 2, 64, "founder")

        b = NodeProcess("B", [*PER_STEP, "--init-from", str(tmp_path / "joiner")], run_id, initial_peers=maddrs)
        nodes.append(b)
        b.wait_ready()
        assert b.status()["params_sha256"] == a.status()["params_sha256"]  # the swarm's state, not its own
        assert b.status()["first_state"] == "download"  # at epoch 0 too: its own start is not the swarm's

        out = subprocess.run([sys.executable, "-m", "dtrain.clients.export", "--node", a.url, "--out",
                              str(tmp_path / "exported")], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert a.status()["params_sha256"] in out.stdout
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / "exported")
        ids = tokenizer("Shall I compare thee", return_tensors="pt").input_ids
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, founder_model(ids).logits)
        # and the node's own answer on the same tokens: greedy next token of the /v1 API
        answer = json.loads(urllib.request.urlopen(urllib.request.Request(
            a.url + "/v1/completions", json.dumps({"model": "founder", "prompt": ids[0].tolist(), "max_tokens": 1,
                                                   "temperature": 0, "logprobs": 1}).encode(),
            {"Content-Type": "application/json"}), timeout=60).read())
        with torch.no_grad():
            logprobs = torch.log_softmax(loaded(ids).logits[0, -1], -1)
        expected = int(logprobs.argmax())
        assert answer["choices"][0]["text"] == tokenizer.decode([expected])
        assert np.isclose(answer["choices"][0]["logprobs"]["token_logprobs"][0], float(logprobs[expected]), atol=1e-4)
    finally:
        for node in nodes:
            node.kill()


def test_an_import_that_is_not_a_gpt2_is_refused_before_the_node_starts(tmp_path):
    _save(tmp_path / "m", seed=0)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    out = subprocess.run([sys.executable, "-m", "dtrain.cli", "--init-from", str(tmp_path / "m")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--init-from" in out.stderr and "activation_function" in out.stderr, out.stderr


@pytest.mark.timeout(180)
def test_a_joiner_of_another_shape_stops_before_it_joins(tmp_path):
    _save(tmp_path / "founder", seed=0)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**{**SHAPE, "n_layer": 1})).save_pretrained(tmp_path / "shallow")
    run_id = new_run_id()
    a = NodeProcess("A", [*PER_STEP, "--init-from", str(tmp_path / "founder")], run_id)
    try:
        maddrs = a.wait_ready()
        b = NodeProcess("B", [*PER_STEP, "--init-from", str(tmp_path / "shallow")], run_id, initial_peers=maddrs)
        try:
            wait_until(lambda: b.proc.poll() is not None, 90, "the joiner of another shape to stop")
            assert b.proc.returncode == 2, b.output()[-3000:]
            assert "the swarm trains another model" in b.output() and "'n_layers': (2, 1)" in b.output()
            assert "Loading the swarm's parameters" not in b.output()  # stopped before it downloaded anything
        finally:
            b.kill()
        assert a.status()["step"] == 1 and a.proc.poll() is None  # the swarm goes on, untouched
    finally:
        a.kill()
