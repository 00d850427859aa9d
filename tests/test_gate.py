"""The bridge's gate over real HTTP on 127.0.0.1: 401 without a token, 400 above the samples cap, 429 with
Retry-After over the rate, CORS letting browsers send Authorization and read Retry-After.

The app is built here from `bridge.http.install` and a small submit handler calling the gate the way the
real route does (the real route is being rewired): decode, gate, then "apply" into a list the test reads.
"""

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp import web

from dtrain.bridge import dgrd
from dtrain.bridge.gate import Gate, GateConfig, GateConfigError, GateError, TokenBuckets, load_tokens
from dtrain.bridge.http import ApiError, install, read_body
from dtrain.node.train.ledger import ContributorLedger

pytestmark = pytest.mark.unit

ELEMENTS = [16, 4]
APPLIED = web.AppKey("applied", list)
GATE = web.AppKey("gate", Gate)
LEDGER = web.AppKey("ledger", ContributorLedger)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


async def submit(request: web.Request) -> web.Response:
    gate, ledger = request.app[GATE], request.app[LEDGER]
    gate.authorize(request.headers)
    gate.check_address(request.remote)
    body = await read_body(request, dgrd.max_packet_bytes(ELEMENTS))
    try:
        packet = dgrd.decode(body, ELEMENTS)
    except dgrd.PacketError as e:
        raise ApiError(400, f"malformed packet: {e}", server_step=0) from None
    try:
        gate.check_packet(packet.node_id, packet.samples, server_step=0)
    except GateError as e:
        ledger.rejected(packet.node_id, e.reason)
        raise
    request.app[APPLIED].append(packet)
    ledger.accepted(packet.node_id, packet.samples)
    return web.json_response({"ok": True, "message": "ok", "server_step": 0})


@contextlib.asynccontextmanager
async def serve(gate: Gate):
    app = web.Application()
    install(app)
    app[APPLIED], app[GATE], app[LEDGER] = [], gate, ContributorLedger()
    app.router.add_post("/api/v1/train/submit", submit)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}",
                                         timeout=aiohttp.ClientTimeout(total=10)) as session:
            yield app, session
    finally:
        await runner.cleanup()


def packet(node_id="browser-1", samples=4):
    return dgrd.encode(0, node_id, 2.5, samples, [(0, [1, 3], [0.5, -0.25])])


async def post(session, data, **headers):
    async with session.post("/api/v1/train/submit", data=data, headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens.txt"
    path.write_text("# contributors of the closed swarm\nalpha-token\n\n  beta-token  \n")
    return str(path)


def test_open_by_default_and_samples_cap_is_a_400_naming_it():
    async def go():
        async with serve(Gate(GateConfig(max_samples_per_packet=64))) as (app, s):
            assert (await post(s, packet(samples=64)))[0] == 200
            status, _, body = await post(s, packet(samples=65))
            assert status == 400 and body["ok"] is False
            assert "max_samples_per_packet 64" in body["message"] and "65" in body["message"]
            assert body["server_step"] == 0
            status, _, _ = await post(s, packet(samples=2**32 - 1))
            assert status == 400
            assert [p.samples for p in app[APPLIED]] == [64]  # nothing of the refused packets applied
            record = app[LEDGER].get("browser-1")
            assert (record.accepted, record.samples_claimed, record.rejected) == (1, 64, {"samples_cap": 2})
    run(go())


def test_without_a_valid_token_401_and_nothing_applied(tokens_file):
    async def go():
        async with serve(Gate(GateConfig(contributor_tokens=tokens_file))) as (app, s):
            status, headers, body = await post(s, packet())
            assert status == 401 and "Authorization: Bearer" in body["message"]
            assert headers["WWW-Authenticate"].startswith("Bearer")
            assert headers["Access-Control-Allow-Origin"] == "*"
            assert (await post(s, packet(), Authorization="Bearer gamma-token"))[0] == 401
            assert (await post(s, packet(), Authorization="Basic alpha-token"))[0] == 401
            assert (await post(s, packet(), Authorization="Bearer "))[0] == 401
            assert app[APPLIED] == []
            assert (await post(s, packet(), Authorization="Bearer alpha-token"))[0] == 200
            assert (await post(s, packet("b2"), Authorization="bearer beta-token"))[0] == 200
            assert [p.node_id for p in app[APPLIED]] == ["browser-1", "b2"]
            # a bad token is refused before the body is even looked at: garbage gets 401, not 400
            assert (await post(s, b"not a packet", Authorization="Bearer nope"))[0] == 401
    run(go())


def test_rate_limit_is_a_429_with_retry_after_per_node_id():
    clock = Clock()

    async def go():
        async with serve(Gate(GateConfig(rate_per_s=0.5, burst=2), clock=clock)) as (app, s):
            assert [(await post(s, packet()))[0] for _ in range(2)] == [200, 200]
            status, headers, body = await post(s, packet())
            assert status == 429 and headers["Retry-After"] == "2" and "retry after 2 s" in body["message"]
            assert (await post(s, packet("someone-else")))[0] == 200  # buckets are per node_id
            clock.now += 1.0  # half a token: still 1 s to wait
            status, headers, _ = await post(s, packet())
            assert status == 429 and headers["Retry-After"] == "1"
            clock.now += 1.0
            assert (await post(s, packet()))[0] == 200
            assert len(app[APPLIED]) == 4
            assert app[LEDGER].get("browser-1").rejected == {"rate_limited": 2}
    run(go())


def test_rate_limit_per_address():
    clock = Clock()

    async def go():
        config = GateConfig(rate_per_s=0, address_rate_per_s=1.0, address_burst=3)
        async with serve(Gate(config, clock=clock)) as (app, s):
            statuses = [(await post(s, packet(f"id{i}")))[0] for i in range(5)]  # new ids do not help
            assert statuses == [200, 200, 200, 429, 429]
            assert len(app[APPLIED]) == 3
    run(go())


def test_cors_lets_browsers_send_the_token_and_read_retry_after():
    async def go():
        async with serve(Gate()) as (_, s):
            async with s.options("/api/v1/train/submit", headers={
                    "Origin": "http://example.org", "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type"}) as r:
                allowed = {h.strip().lower() for h in r.headers["Access-Control-Allow-Headers"].split(",")}
                exposed = {h.strip().lower() for h in r.headers["Access-Control-Expose-Headers"].split(",")}
            assert r.status == 204 and {"authorization", "content-type"} <= allowed and "retry-after" in exposed
    run(go())


def test_tokens_file_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(GateConfigError, match="no such file"):
        load_tokens(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("# nobody yet\n\n")
    with pytest.raises(GateConfigError, match="no tokens"):
        Gate(GateConfig(contributor_tokens=str(empty)))
    spaced = tmp_path / "spaced.txt"
    spaced.write_text("two tokens\n")
    with pytest.raises(GateConfigError, match="whitespace"):
        load_tokens(spaced)
    with pytest.raises(GateConfigError, match="max_samples_per_packet"):
        GateConfig(max_samples_per_packet=0)


def test_buckets_are_bounded_and_refill_at_their_rate():
    clock = Clock()
    buckets = TokenBuckets(rate_per_s=4.0, burst=2, max_keys=4, clock=clock)
    for i in range(100):
        assert buckets.take(f"sybil{i}") == 0.0
    assert len(buckets) == 4
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.25]
    clock.now += 0.25
    assert buckets.take("a") == 0.0
