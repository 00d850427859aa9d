"""Two nodes with the default trusted reference (`--reference-batch 4`): a contributor whose real gradients are
sign-flipped is counted 0 and then refused (403) by the node it sends to, while honest real gradients sent to both
nodes make one joint update with the same bytes on both. Records are per node: the other node has none of it."""
from __future__ import annotations

import pytest

from tests.nodeproc import PER_STEP, TINY_CONFIG, NodeProcess, new_run_id, shown_on_failure, wait_until
from tests.test_bridge_semantics import download_f32
from tests.test_reference_http import contributor, ledger, post, real_packet

pytestmark = pytest.mark.swarm

SAMPLES = 2  # per honest packet; the swarm's target is one packet at each node


@pytest.mark.timeout(240)
def test_a_scored_out_contributor_gets_403_while_the_swarm_trains_on_honest_gradients():
    run_id = new_run_id()
    args = [*PER_STEP, "--model-config", str(TINY_CONFIG), "--target-batch-size", str(2 * SAMPLES), "--reference-batch", "4",
            "--rate-burst", "100"]
    a = NodeProcess("A", args, run_id)
    nodes = [a]
    with shown_on_failure(nodes):
        b = NodeProcess("B", args, run_id, initial_peers=a.wait_ready())
        nodes.append(b)
        b.wait_ready()
        step = a.get_json("/api/v1/model/info")["step"]
        assert b.get_json("/api/v1/model/info")["step"] == step

        flipper = contributor(a, "flipper")
        for i in range(8):  # each counted 0 at A: nothing to average, no update anywhere
            status, answer = post(a, real_packet(flipper, step, lambda g: -g))
            assert status == 200, answer
            wait_until(lambda: ledger(a).get("flipper", {}).get("disagreed") == i + 1, 30, f"flipped packet {i}")
        assert ledger(a)["flipper"]["scored_out"] and ledger(a)["flipper"]["samples_credited"] == 0
        status, answer = post(a, real_packet(flipper, step, lambda g: -g))
        assert status == 403 and "flipper" in answer["message"], answer
        assert [n.get_json("/api/v1/model/info")["step"] for n in nodes] == [step, step]

        for i, node in enumerate(nodes):
            status, answer = post(node, real_packet(contributor(node, f"honest-{i}"), step, samples=SAMPLES))
            assert status == 200, answer
        wait_until(lambda: all(n.get_json("/api/v1/model/info")["step"] > step for n in nodes), 120,
                   "both nodes to apply the swarm's update")
        manifest = a.get_json("/api/v1/model/manifest")["tensors"]
        step_a, after_a = download_f32(a, manifest)
        step_b, after_b = download_f32(b, manifest)
        assert step_a == step_b == step + 1
        assert all(x.tobytes() == y.tobytes() for x, y in zip(after_a, after_b))
        for i, node in enumerate(nodes):
            record = ledger(node)[f"honest-{i}"]
            assert (record["samples_credited"], record["agreed"], record["disagreed"]) == (SAMPLES, 1, 0)
        assert "flipper" not in ledger(b)  # B never saw it: each node judges what it is sent
        assert ledger(a)["flipper"]["rejected"] == {"scored_out": 1}
