"""`--feedback-lora`: two real nodes on 127.0.0.1 train one LoRA adapter on the feedback each was given, average it
through the adapter's own hivemind run, and serve the new adapter by name without a restart; the shared model is
untouched. Bad names are refused: at the command line, and with OpenAI's error shape over HTTP."""
from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from dtrain.node.serve.adapter import adapter_digest, adapter_seed
from dtrain.node.split.experts import LoraExpert
from tests.nodeproc import PER_STEP, REPO, TINY_CONFIG, NodeProcess, new_run_id, print_logs, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

MODEL = json.loads(TINY_CONFIG.read_text())["name"]
ADAPTER = "agent"
PROMPT = "repeat: cat ->"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapter")
    run_id = new_run_id()

    def args(name: str) -> list[str]:
        return [*PER_STEP, "--model-config", str(TINY_CONFIG), "--no-data", "--feedback-lora", ADAPTER,
                "--feedback-lora-target", "2", "--feedback-lora-lr", "0.05", "--feedback-interval", "0.5",
                "--capture-db", str(tmp / f"{name}.sqlite")]
    nodes = [NodeProcess("A", args("A"), run_id)]
    try:
        maddrs = nodes[0].wait_ready()
        nodes.append(NodeProcess("B", args("B"), run_id, initial_peers=maddrs))
        nodes[1].wait_ready()
        yield nodes
    except BaseException:
        print_logs(nodes)
        raise
    finally:
        for node in nodes:
            node.terminate()


def _client(node) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _entry(node, name: str) -> dict:
    return node.get_json(f"/v1/models/{name}")


def _greedy(node, model: str):
    r = _client(node).completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    return r, list(r.choices[0].logprobs.token_logprobs)


def test_two_nodes_average_the_adapter_and_serve_it_hot(pair):
    a, b = pair
    initial = LoraExpert.create(ADAPTER, 32, r=8, alpha=16.0, seed=adapter_seed(ADAPTER))
    for node in pair:
        models = [m["id"] for m in node.get_json("/v1/models")["data"]]
        assert models == [MODEL, ADAPTER]
        entry = _entry(node, ADAPTER)
        assert entry["dtrain_expert"] is True
        assert entry["dtrain_adapter"] == {"epoch": 0, "sha256": adapter_digest(initial), "samples": 0, "peers": 0}
    base_step = _entry(a, MODEL)["dtrain_step"]

    # the adapter starts as the bare model (B = 0): the same greedy answer, the same log-probabilities
    before, before_lp = _greedy(a, ADAPTER)
    _, base_lp = _greedy(a, MODEL)
    assert before_lp == base_lp
    answers = {}
    for node in pair:  # both nodes serve the same step, so both write the same greedy answer; both reward it
        r, lp = _greedy(node, ADAPTER)
        assert (r.choices[0].text, lp) == (before.choices[0].text, before_lp)
        answers[node.name] = r
    for node in pair:
        r = answers[node.name]
        _client(node).post("/feedback", body={"id": r.id, "reward": 1.0,
                                              "feedback_token": r.model_extra["dtrain_feedback_token"]}, cast_to=object)

    def updated():
        entries = [_entry(node, ADAPTER)["dtrain_adapter"] for node in pair]
        return entries if all(e["epoch"] >= 1 for e in entries) else None
    try:
        entries = wait_until(updated, 90, "the adapter's first update on both nodes")
    except TimeoutError:
        print_logs(pair)
        raise
    ea, eb = entries
    assert ea["epoch"] == eb["epoch"] == 1
    assert ea["sha256"] == eb["sha256"] != adapter_digest(initial)  # byte-identical, and trained
    assert ea["samples"] == eb["samples"] == 1  # each node's own reward went in ...
    assert ea["peers"] == eb["peers"] == 2, print_logs(pair)  # ... into one all-reduce of both

    # served hot: the same request to model=agent now reads the new adapter; the shared model did not move
    for node in pair:
        after, after_lp = _greedy(node, ADAPTER)
        assert after_lp != before_lp
        if after.choices[0].text == before.choices[0].text:  # the rewarded answer became more likely
            assert sum(after_lp) > sum(before_lp)
        assert _greedy(node, MODEL)[1] == base_lp
        assert _entry(node, MODEL)["dtrain_step"] == base_step


def test_bad_adapter_requests_get_openai_errors(pair):
    client = _client(pair[0])
    for name in ("agent2", "agent/../x", ""):
        with pytest.raises((openai.NotFoundError, openai.BadRequestError)) as caught:
            client.completions.create(model=name, prompt="hi", max_tokens=1)
        body = caught.value.body
        assert body["param"] == "model" and body["type"] and body["message"], body
        assert caught.value.status_code in (400, 404)
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("agent2")
    assert caught.value.body["code"] == "model_not_found"


def test_adapter_named_like_the_shared_model_is_refused_before_the_node_starts(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dtrain.cli", *PER_STEP, "--model-config", str(TINY_CONFIG), "--feedback-lora",
                          MODEL, "--capture-db", str(tmp_path / "c.sqlite")], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and f"--feedback-lora {MODEL!r}" in out.stderr, out.stderr
