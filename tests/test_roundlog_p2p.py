"""The round log's answer over a real libp2p stream on 127.0.0.1 (node.lowcomm.roundlog)."""
from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P

from dtrain.node.lowcomm import roundlog
from tests.test_roundlog import entry

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(60)]


def test_a_peer_answers_with_its_log_over_libp2p_and_a_long_answer_is_cut_off():
    log = roundlog.RoundLog()
    for epoch in range(3, 9):
        # round 8: four members' payloads of 300,000 elements, 1.4 MB (a record larger than one chunk)
        log.add(epoch, entry(epoch, members=4 if epoch == 8 else 2, count=300_000 if epoch == 8 else 30,
                             total=400_000))

    async def run():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(initial_peers=[str(m) for m in await server.get_visible_maddrs()],
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            await server.add_protobuf_handler(roundlog.LOG_HANDLER, roundlog.handler(log),
                                              roundlog.wrappers_pb2.BytesValue, stream_output=True)
            got = await roundlog.fetch(client, server.peer_id, 4, 3, 1 << 20, 30.0)
            assert got == roundlog.frame(log.after(4, 3))
            big = await roundlog.fetch(client, server.peer_id, 7, 1, 1 << 21, 30.0)  # several chunks
            assert big == roundlog.frame(log.after(7, 1))
            with pytest.raises(roundlog.BadRoundLog):
                await roundlog.fetch(client, server.peer_id, 7, 1, 1 << 20, 30.0)
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(run())
