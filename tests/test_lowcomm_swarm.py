"""Low-communication mode on real nodes on 127.0.0.1: outer rounds averaged by every node, equal steps mean equal
bytes throughout, and every sample a node trained on is applied by an outer update, once. With the sparse codec the
nodes compute the same outer update to the bit: no node ever finds its parameters differ from its peer's."""
from __future__ import annotations

import pytest

from tests.nodeproc import TINY_CONFIG, new_run_id, shown_on_failure, start_swarm, wait_until
from tests.swarmcheck import ByteWatch
from tests.texts import shakespeare

pytestmark = pytest.mark.swarm

INNER = 4
ROUNDS = 2  # outer rounds both nodes apply


@pytest.fixture
def args(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(shakespeare(30_000))
    return ["--model-config", str(TINY_CONFIG), "--train-data", str(path), "--local-batch-size", "2",
            "--local-seq-len", "32", "--sync", "low-comm", "--inner-steps", str(INNER)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("codec,in_rounds", [("fp16", "off"), ("sparse", "batches"), ("sparse", "copy")])
def test_two_nodes_average_outer_rounds_and_serve_equal_bytes(args, codec, in_rounds):
    """`in_rounds`: what a node trains while its round runs: nothing (--no-train-in-rounds), one inner update's
    batches (the default on the CPU), or inner updates of a copy of the model of its own (--inner-copy: what a GPU
    node does, here on the CPU through the same code)."""
    flags = [*args, "--wire-codec", codec, "--topk-fraction", "0.05",
             *{"off": ("--no-train-in-rounds",), "batches": (), "copy": ("--inner-copy",)}[in_rounds]]
    nodes = start_swarm(2, flags, new_run_id())
    with shown_on_failure(nodes):
        start = max(n.status()["step"] for n in nodes)
        with ByteWatch(nodes) as watch:
            wait_until(lambda: min(n.status()["step"] for n in nodes) >= start + ROUNDS, 150, "the outer rounds", 0.5)
        assert not watch.conflicts, watch.conflicts[:5]
        for node in nodes:
            averaged = [line for line in node.output().splitlines() if "Averaged gradients with 2 peers" in line]
            assert averaged, f"node {node.name} averaged no outer round with its peer"
            s = node.status()
            assert (s["sync"], s["wire_codec"], s["closed"]) == ("low-comm", codec, False)
            # a round holds INNER local batches trained between rounds (or one more, after a round that failed),
            # and what was trained while the last round ran: the first of them, or a copy's INNER more; nothing is
            # dropped
            trains_in_rounds = in_rounds != "off"
            batches = INNER + trains_in_rounds + (INNER if in_rounds == "copy" else 0)
            assert s["applied_samples"] > 0 and s["pending_samples"] <= batches * 2
            assert (s["round_samples"] > 0) == trains_in_rounds, s["round_samples"]
            copy = "The inner loop trains on cpu" in node.output()
            assert copy == (in_rounds == "copy")
            if codec == "sparse":  # the same payloads, the same average, the same outer step: nothing to download
                differ = [line for line in node.output().splitlines() if "parameters differ" in line]
                assert not differ, differ
        for node in nodes:
            node.terminate()
