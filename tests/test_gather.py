"""The sparse round's all-to-all exchange (node.lowcomm.gather) among real hivemind averagers on 127.0.0.1, two of
them client-mode peers that nobody can dial: every member ends the round with the same bits, the codec's average of
the four payloads. Who calls whom is tested in tests/test_gather_plan.py."""
from __future__ import annotations

import contextlib
import itertools
from functools import partial

import pytest
import torch

from dtrain.node.lowcomm import sparse
from dtrain.node.lowcomm.gather import SparseGatherAverager
from dtrain.node.swarm.records import RecordOwner
from tests.nodeproc import new_run_id
from tests.test_commit import applied, signed_dht

pytestmark = pytest.mark.swarm


ELEMENTS, FRACTION = 200_000, 0.1
OPTS = dict(min_matchmaking_time=2.0, allreduce_timeout=20.0, request_timeout=2.0, target_group_size=4,
            min_group_size=4)


@contextlib.contextmanager
def members(client_mode):
    dhts, out = [], []
    try:
        owners = [RecordOwner.generate() for _ in client_mode]
        dhts.append(signed_dht(owners[0]))
        for owner in owners[1:]:
            dhts.append(signed_dht(owner, initial_peers=dhts[0].get_visible_maddrs()))
        prefix = new_run_id()
        g = torch.Generator().manual_seed(0)
        for dht, owner, client in zip(dhts, owners, client_mode):
            param = torch.nn.Parameter(torch.zeros(ELEMENTS))
            param.grad = sparse.top_k([torch.randn(ELEMENTS, generator=g)], FRACTION, half=True)[0]
            averager = SparseGatherAverager([param], dht=dht, prefix=prefix, start=True, fraction=FRACTION,
                                            record_subkey=owner.subkey, client_mode=client, **OPTS)
            out.append((param, averager))
        yield out
    finally:
        for _, averager in out:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_a_round_with_client_mode_members_ends_with_the_same_bits_on_every_member():
    with members([False, True, False, True]) as group:
        offers = [param.grad.clone() for param, _ in group]
        for _, averager in group:
            averager.accumulate_grads_(batch_size=1)
        controls = [averager.step(wait=False, timeout=30.0, allow_retries=False) for _, averager in group]
        results = []
        for control, (param, averager) in zip(controls, group):
            result = control.result(60.0)
            assert applied(result), result
            with averager.use_averaged_gradients():
                results.append(param.grad.clone())
    first = results[0].numpy().tobytes()
    assert all(r.numpy().tobytes() == first for r in results), "members ended the round with different bits"
    exact = torch.stack([o.double() for o in offers]).mean(0)
    assert torch.allclose(results[0].double(), exact, atol=1e-6)
    # and the bits are those of the codec's average of the four payloads, in some order of the group
    decoded = [sparse.decode(sparse.encode(o, half=True), ELEMENTS, sparse.kept(ELEMENTS, FRACTION), half=True)
               for o in offers]
    assert any(sparse.average([decoded[i] for i in order], [1.0] * 4, ELEMENTS).numpy().tobytes() == first
               for order in itertools.permutations(range(4)))
