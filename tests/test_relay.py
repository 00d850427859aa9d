"""dtrain-relay: bytes pass both ways unchanged through a real TCP relay, and its address arguments are checked."""
import asyncio
import os

import aiohttp
import pytest
from aiohttp import web

from dtrain.clients.relay import RelayConfig, _host_port, start

pytestmark = pytest.mark.unit

PAYLOAD = os.urandom(3 * 1024 * 1024 + 17)  # larger than the relay's read buffer many times over


async def blob(request: web.Request) -> web.Response:
    return web.Response(body=PAYLOAD, content_type="application/octet-stream")


async def echo(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.TEXT:
            await ws.send_str("echo:" + msg.data)
        elif msg.type == aiohttp.WSMsgType.BINARY:
            await ws.send_bytes(msg.data[::-1])
    return ws


async def upload(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"bytes": len(body), "first": body[:4].hex()})


async def run_through_relay(check) -> None:
    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_get("/blob", blob)
    app.router.add_get("/ws", echo)
    app.router.add_post("/upload", upload)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    target_port = site._server.sockets[0].getsockname()[1]
    relay = await start(RelayConfig("127.0.0.1", 0, "127.0.0.1", target_port, buffer_bytes=16 * 1024))
    relay_port = relay.sockets[0].getsockname()[1]
    try:
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await check(session, f"http://127.0.0.1:{relay_port}")
    finally:
        relay.close()
        await relay.wait_closed()
        await runner.cleanup()


@pytest.mark.timeout(30)
def test_http_download_and_upload_are_byte_exact():
    async def check(session, base):
        for _ in range(2):
            async with session.get(base + "/blob") as resp:
                assert resp.status == 200
                body = await resp.read()
            assert body == PAYLOAD
        async with session.post(base + "/upload", data=PAYLOAD) as resp:
            assert await resp.json() == {"bytes": len(PAYLOAD), "first": PAYLOAD[:4].hex()}

    asyncio.run(run_through_relay(check))


@pytest.mark.timeout(30)
def test_websocket_echo_through_relay():
    async def check(session, base):
        async with session.ws_connect(base + "/ws") as ws:
            for i in range(5):
                await ws.send_str(f"message {i}")
                msg = await ws.receive(timeout=5)
                assert msg.type == aiohttp.WSMsgType.TEXT and msg.data == f"echo:message {i}"
            data = os.urandom(200_000)
            await ws.send_bytes(data)
            msg = await ws.receive(timeout=5)
            assert msg.type == aiohttp.WSMsgType.BINARY and msg.data == data[::-1]

    asyncio.run(run_through_relay(check))


@pytest.mark.timeout(30)
def test_unreachable_target_closes_the_client():
    async def scenario():
        # a port that was free a moment ago: nothing listens there
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        dead_port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        relay = await start(RelayConfig("127.0.0.1", 0, "127.0.0.1", dead_port))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.sockets[0].getsockname()[1])
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await asyncio.wait_for(reader.read(), timeout=10) == b""
            writer.close()
        finally:
            relay.close()
            await relay.wait_closed()

    asyncio.run(scenario())


def test_host_port_flag_parsing():
    assert _host_port("0.0.0.0:9095", "--listen") == ("0.0.0.0", 9095)
    assert _host_port("[::1]:80", "--target") == ("::1", 80)
    for bad in ("9095", ":80", "host:", "host:99999", "host:x"):
        with pytest.raises(Exception, match="HOST:PORT"):
            _host_port(bad, "--listen")
