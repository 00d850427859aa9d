"""The pool's byte bound (--max-pending-mib): over it a packet is refused with 503 and Retry-After and changes
nothing; an empty pool, and a contributor new to a group that holds every byte, still get in."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dtrain.bridge import dgrd
from dtrain.node.contribution import Contribution, Section
from dtrain.node.train.pool import ContributionPool, PoolFull
from tests.nodeproc import REPO, TINY_CONFIG
from tests.test_bridge_http import _start, current_step, request, submit, wait_step

pytestmark = pytest.mark.http

TINY = json.loads(TINY_CONFIG.read_text())


def _contribution(contributor: str, nbytes: int) -> Contribution:
    section = Section(0, None, np.zeros(nbytes // 4, np.float32))
    return Contribution(contributor, 1, 1, 2.0, (section,))


def test_bound_refuses_and_take_frees():
    pool = ContributionPool(min_contributors=1, current_step=lambda: 1, max_bytes=1000)
    pool.add(_contribution("a", 4000))  # an empty pool takes a packet larger than the bound
    with pytest.raises(PoolFull) as e:
        pool.add(_contribution("b", 400))  # a group is ready: the training thread will free it
    assert (e.value.held_bytes, e.value.max_bytes) == (4000, 1000)
    assert pool.counters().accepted_packets == 1
    assert [c.contributor for c in pool.take().contributions] == ["a"]
    pool.add(_contribution("b", 400))
    pool.add(_contribution("c", 600))  # 1000: at the bound, not over it
    with pytest.raises(PoolFull):
        pool.add(_contribution("d", 4))


def test_a_group_that_holds_every_byte_still_completes():
    """min_contributors 3: one node_id filling the pool must not lock out the contributors that complete the group."""
    pool = ContributionPool(min_contributors=3, current_step=lambda: 1, max_bytes=1000)
    pool.add(_contribution("a", 800))
    with pytest.raises(PoolFull):
        pool.add(_contribution("a", 800))  # the same contributor again: refused
    pool.add(_contribution("b", 800))  # new to the group: taken, over the bound
    with pytest.raises(PoolFull):
        pool.add(_contribution("b", 8))
    assert pool.take() is None
    pool.add(_contribution("c", 800))  # completes the group
    assert [c.contributor for c in pool.take().contributions] == ["a", "b", "c"]
    pool.add(_contribution("a", 800))  # empty again


@pytest.fixture(scope="module")
def bounded_node(tmp_path_factory):
    train = tmp_path_factory.mktemp("bound") / "train.json"
    # two contributors per update: one node_id's packets wait in the pool until a second one submits
    defaults = json.loads((REPO / "dtrain" / "static" / "train_config.json").read_text())
    train.write_text(json.dumps({**defaults, "min_nodes_for_update": 2}))
    node = _start("bound", ["--model-config", str(TINY_CONFIG), "--train-config", str(train),
                            "--target-batch-size", "1", "--max-pending-mib", "1", "--rate-limit", "0"])
    yield node
    node.kill()


def _wte(node) -> np.ndarray:
    return np.frombuffer(request(node, "GET", "/api/v1/model/tensor/0?format=f32").body, "<f4")


def test_overfilled_node_answers_503_and_applies_nothing_of_it(bounded_node):
    node = bounded_node
    step = current_step(node)
    wte = TINY["vocab_size"] * TINY["d_model"]  # tensor 0, dense: 3.2 MB in FP16, over the 1 MiB bound
    packet = lambda who, value: dgrd.encode(step, who, 2.0, 1, [(0, None, np.full(wte, value, np.float32))])  # noqa
    before = _wte(node)

    assert submit(node, packet("a", 1e-3)).status == 200  # the pool was empty
    refused = submit(node, packet("a", -1e-2))  # a's group holds 3.2 MB already
    assert refused.status == 503, refused.body
    body = refused.json()
    assert body["ok"] is False and body["server_step"] == step and "node busy" in body["message"]
    assert int(refused.headers["Retry-After"]) >= 1
    assert "Retry-After" in refused.headers["Access-Control-Expose-Headers"]
    status = node.get_json("/api/v1/swarm/status")
    assert (status["accepted_packets"], status["pending_contributors"], status["step"]) == (1, 1, step)

    assert submit(node, packet("b", 1e-3)).status == 200  # new to the group: completes it
    wait_step(node, step + 1)
    status = node.get_json("/api/v1/swarm/status")
    assert (status["accepted_packets"], status["applied_packets"]) == (2, 2)
    # AdamW's first step moves every element against the sign of the mean gradient: +1e-3 from a and b alone. Had
    # the refused -1e-2 gone in, the mean would be negative and every element would have moved up.
    assert np.all(_wte(node) < before)
    ledger = {r["node_id"]: r for r in node.get_json("/api/v1/contributors")["contributors"]}
    assert ledger["a"]["accepted"] == 1 and ledger["a"]["rejected"] == {"node_busy": 1}
    assert ledger["b"]["accepted"] == 1 and not ledger["b"]["rejected"]
