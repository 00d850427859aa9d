"""The closed swarm's RPC gate on real hivemind peers on 127.0.0.1 (node.swarm.keygate).

A host without the key can open a libp2p connection to a closed node and learn its RPC names (identify lists them);
these tests call the node's state averager and its reachability check directly, as such a host would. The same
call to an open node gets the state: the refusal is the gate's, not a broken call.
"""
from __future__ import annotations

import asyncio
from typing import Optional

import hivemind
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.compression import deserialize_torch_tensor
from hivemind.utils.streaming import combine_from_streaming

from dtrain.node.swarm import reachability as r
from dtrain.node.swarm.keygate import NONCE_BYTES, add_prover, proof, start_prover
from dtrain.node.swarm.state import SwarmStateAverager
from dtrain.node.swarm.records import RecordOwner
from dtrain.node.swarm.swarmkey import SwarmKeyAuthorizer

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

KEY, OTHER_KEY = b"k" * 32, b"o" * 32
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
PREFIX = "gated_state_averager"
CALL_BOUND_S = 30.0


def test_a_proof_names_the_nonce_both_peers_and_their_roles():
    a, b = (PeerID.from_base58(RecordOwner.generate().peer_id) for _ in range(2))
    nonce = bytes(range(NONCE_BYTES))
    good = proof(KEY, nonce, a, b)
    assert proof(KEY, nonce, a, b) == good
    assert proof(OTHER_KEY, nonce, a, b) != good
    assert proof(KEY, bytes(NONCE_BYTES), a, b) != good
    assert proof(KEY, nonce, b, a) != good  # a key holder's answer to the caller's own challenge is no answer


def start_node(key: Optional[bytes], initial_peers=()):
    """A DHT as a node starts it (HMAC'd with `key`, answering challenges) and a state averager whose parameters
    are 0..9."""
    dht = hivemind.DHT(host_maddrs=LOCAL, initial_peers=list(initial_peers), start=True,
                       authorizer=SwarmKeyAuthorizer(key) if key else None)
    if key:
        start_prover(dht, key)
    params = [torch.nn.Parameter(torch.arange(10, dtype=torch.float32))]
    averager = SwarmStateAverager(swarm_key=key, dht=dht, prefix=PREFIX, optimizer=torch.optim.SGD, params=params,
                                  start=True)
    return dht, averager


async def _download_as_stranger(target: hivemind.DHT, prover_key: Optional[bytes]) -> list[torch.Tensor]:
    """Connect to `target`'s daemon from a host of our own (no DHT: it could not join a closed one) and call the
    state averager's download RPC directly; the tensors it streams back."""
    stranger = await P2P.create(initial_peers=[str(m) for m in target.get_visible_maddrs()], host_maddrs=LOCAL)
    try:
        if prover_key:
            await add_prover(stranger, prover_key)
        stub = SwarmStateAverager.get_stub(stranger, target.peer_id, namespace=PREFIX)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        tensors: list[list] = []
        async for message in stream:
            if message.tensor_part.dtype:  # a tensor's first chunk names its dtype; the rest carry bytes only
                tensors.append([])
            if tensors:
                tensors[-1].append(message.tensor_part)
        return [deserialize_torch_tensor(combine_from_streaming(chunks)) for chunks in tensors]
    finally:
        await stranger.shutdown()


def download_as_stranger(target: hivemind.DHT, prover_key: Optional[bytes] = None):
    """(tensors, error): what a direct download got, and the error it ended with, if any."""
    async def run():
        try:
            return await asyncio.wait_for(_download_as_stranger(target, prover_key), CALL_BOUND_S), None
        except asyncio.TimeoutError:
            raise
        except Exception as e:
            return [], e
    return asyncio.run(run())


def test_a_closed_node_serves_its_state_only_to_holders_of_the_key():
    open_dht, open_averager = start_node(None)
    closed_dht, closed_averager = start_node(KEY)
    holder_dht, holder_averager = None, None
    try:
        # the attack works on an open node: a host that can reach it downloads its parameters
        got, error = download_as_stranger(open_dht)
        assert error is None and got and torch.equal(got[0], torch.arange(10, dtype=torch.float32))

        # a closed node refuses a host that cannot answer its challenge, or answers it with another key
        for prover_key in (None, OTHER_KEY):
            got, error = download_as_stranger(closed_dht, prover_key)
            assert got == [] and error is not None, f"a stranger (prover key {prover_key!r}) got {got}"
            assert "swarm key" in str(error)

        # a host that holds the key passes the same gate, directly
        got, error = download_as_stranger(closed_dht, KEY)
        assert error is None and got and torch.equal(got[0], torch.arange(10, dtype=torch.float32))

        # and a node of the closed swarm downloads through hivemind as usual
        holder_dht, holder_averager = start_node(KEY, initial_peers=closed_dht.get_visible_maddrs())
        with torch.no_grad():
            holder_averager.main_parameters[0].zero_()
        holder_averager.load_state_from_peers(timeout=CALL_BOUND_S)
        assert torch.equal(holder_averager.main_parameters[0], torch.arange(10, dtype=torch.float32))
    finally:
        for averager in (holder_averager, closed_averager, open_averager):
            if averager is not None:
                averager.shutdown()
        for dht in (holder_dht, closed_dht, open_dht):
            if dht is not None:
                dht.shutdown()


def test_a_closed_node_answers_the_dial_back_check_only_for_holders_of_the_key():
    dht = hivemind.DHT(host_maddrs=LOCAL, authorizer=SwarmKeyAuthorizer(KEY), start=True)
    service = r.ReachabilityService(dht, KEY)
    try:
        peers = [str(m) for m in dht.get_visible_maddrs()]
        ok = r.check_reachability(peers, LOCAL, [], swarm_key=KEY)
        assert (ok.verdict, ok.answered, ok.dialed) == ("reachable", 1, 1)
        for key in (None, OTHER_KEY):  # no answer at all: nothing is dialed for a stranger
            refused = r.check_reachability(peers, LOCAL, [], swarm_key=key)
            assert (refused.verdict, refused.asked, refused.answered) == ("unchecked", 1, 0), key
    finally:
        service.shutdown()
        dht.shutdown()
