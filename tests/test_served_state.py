"""What a low-comm node hands a downloading peer (node.swarm.state.ServedState), on a real hivemind state
averager on 127.0.0.1 called through its download RPC: the served snapshot's parameters and the outer momentum of
their epoch, whatever the inner updates did to the live parameters; nothing while the outer state is not the
snapshot's, and the next snapshot once it is published."""
from __future__ import annotations

import hivemind
import numpy as np
import pytest
import torch

from dtrain.node.lowcomm.outer import OuterNesterov
from dtrain.node.swarm import state as swarm_state
from dtrain.node.swarm.state import ServedState, SwarmStateAverager
from tests.test_keygate import LOCAL, PREFIX, download_as_stranger

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

ANCHOR = np.arange(10, dtype=np.float32)


@pytest.fixture
def node(monkeypatch):
    monkeypatch.setattr(swarm_state, "SERVED_WAIT_S", 0.5)
    dht = hivemind.DHT(host_maddrs=LOCAL, start=True)
    param = torch.nn.Parameter(torch.from_numpy(ANCHOR.copy()))
    averager = SwarmStateAverager(swarm_key=None, dht=dht, prefix=PREFIX, optimizer=OuterNesterov, params=[param],
                                  start=True)
    try:
        yield dht, averager, param
    finally:
        averager.shutdown()
        dht.shutdown()


def test_a_download_gets_the_served_epoch_not_the_inner_updates_and_nothing_torn(node):
    dht, averager, param = node
    outer = averager.optimizer
    averager.served = ServedState(0, (ANCHOR.copy(),), outer.version)
    with torch.no_grad():
        param.add_(5.0)  # inner updates move the live parameters away from the anchor
    got, error = download_as_stranger(dht)
    assert error is None, error
    # the anchor and its (zero) momentum in 8 bits: the codes and their one block's scale
    assert [t.tolist() for t in got] == [ANCHOR.tolist(), [0] * 10, [0.0]] and got[1].dtype == torch.int8

    # an outer step writes the momentum: until the snapshot it makes is published, nothing is handed out
    with torch.no_grad():
        param.copy_(torch.from_numpy(ANCHOR))
        param.grad = torch.ones(10)
    outer.step()
    got, error = download_as_stranger(dht)
    assert got == [] and error is not None, got

    # published: the new epoch's parameters with the momentum that step made
    stepped = param.detach().numpy().copy()
    assert not np.array_equal(stepped, ANCHOR)
    averager.served = ServedState(0, (stepped,), outer.version)
    got, error = download_as_stranger(dht)
    assert error is None, error
    assert got[0].numpy().tobytes() == stepped.tobytes()
    assert got[1].tolist() == [127] * 10 and got[2].tolist() == [np.float32(1.0) / np.float32(127.0)]
