"""Two nodes, contributors submitting to each node's bridge: one joint update, the same tensors on both."""
from __future__ import annotations

import numpy as np
import pytest

from dtrain.bridge import dgrd
from tests.nodeproc import PER_STEP, TINY_CONFIG, NodeProcess, new_run_id, shown_on_failure, wait_until
from tests.test_bridge_semantics import download_f32, submit

pytestmark = pytest.mark.swarm

SAMPLES = 4  # per packet; the swarm's target is both nodes' packets together


@pytest.mark.timeout(240)
def test_contributions_to_two_bridges_make_one_swarm_update():
    run_id = new_run_id()
    args = [*PER_STEP, "--model-config", str(TINY_CONFIG), "--target-batch-size", str(2 * SAMPLES)]
    a = NodeProcess("A", args, run_id)
    nodes = [a]
    with shown_on_failure(nodes):
        b = NodeProcess("B", args, run_id, initial_peers=a.wait_ready())
        nodes.append(b)
        b.wait_ready()
        manifest = a.get_json("/api/v1/model/manifest")["tensors"]
        assert b.get_json("/api/v1/model/manifest")["tensors"] == manifest
        step_before = a.get_json("/api/v1/model/info")["step"]
        assert b.get_json("/api/v1/model/info")["step"] == step_before
        _, params_a = download_f32(a, manifest)
        _, params_b = download_f32(b, manifest)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(params_a, params_b))

        rng = np.random.default_rng(0)
        for i, node in enumerate(nodes):
            # each contributor sends a dense gradient for two tensors and a sparse one for a third
            sections = [(0, None, rng.normal(size=manifest[0]["elements"]).astype(np.float32) * 0.01),
                        (2, np.array([0, 5, 9]), np.array([0.5, -0.25, 1.0], np.float32)),
                        (3, None, rng.normal(size=manifest[3]["elements"]).astype(np.float32) * 0.01)]
            packet = dgrd.encode(step_before, f"browser-{i}", 3.0 + i, SAMPLES, sections, flags=0)
            status, body = submit(node, packet)
            assert status == 200 and body["server_step"] == step_before, body

        wait_until(lambda: all(n.get_json("/api/v1/model/info")["step"] > step_before for n in nodes), 120,
                   "both nodes to apply the swarm's update")
        step_a, after_a = download_f32(a, manifest)
        step_b, after_b = download_f32(b, manifest)
        assert step_a == step_b == step_before + 1
        moved = [not np.array_equal(x, y) for x, y in zip(params_a, after_a)]
        assert moved[0] and moved[2] and moved[3]
        # one update made of both contributions, identical on both nodes to the byte
        for t, x, y in zip(manifest, after_a, after_b):
            assert x.tobytes() == y.tobytes(), f"tensor {t['id']} ({t['name']}) differs between the nodes"
        # a node's loss history records the contributions it received (its own share of the update)
        assert a.get_json("/api/v1/server/losses") == [pytest.approx(3.0)]
        assert b.get_json("/api/v1/server/losses") == [pytest.approx(4.0)]
