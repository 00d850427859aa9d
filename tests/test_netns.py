"""The namespace harness itself: hosts on the segment reach each other, a host behind NAT reaches the segment with
its router's address and cannot be reached from it, a rate limit holds, and nothing outlives a Net."""
import socket
import subprocess
import sys
import time

import pytest

from tests import netns

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.timeout(120),
              pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")]

# a TCP server run with `python -c` inside a namespace: prints its peer's address for each connection, then
# sends `size` bytes (argv[2]) to it
SERVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    c, peer = s.accept()
    print(peer[0], flush=True)
    c.sendall(bytes(int(sys.argv[2])))
    c.close()
"""


def serve(host, port: int, size: int = 0) -> subprocess.Popen:
    proc = host.popen([sys.executable, "-c", SERVER, str(port), str(size)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc


def fetch(ip: str, port: int, timeout_s: float = 2.0) -> int:
    """Connect, read until the server closes; the bytes read."""
    with socket.create_connection((ip, port), timeout=timeout_s) as c:
        c.settimeout(30)
        total = 0
        while chunk := c.recv(1 << 16):
            total += len(chunk)
        return total


def our_namespaces(net: netns.Net) -> list[str]:
    return [n for n in netns._netns_names() if n.startswith(f"{netns.PREFIX}-{netns.os.getpid()}-{net.tag}-")]


def test_segment_hosts_reach_each_other():
    with netns.Net() as net:
        a, b = net.host("a"), net.host("b")
        server = serve(b, 9000, size=1000)
        assert a.call(fetch, b.ip, 9000) == 1000
        assert server.stdout.readline().strip() == a.ip  # no NAT between them


def test_nat_host_reaches_out_with_the_routers_address_and_is_unreachable_from_outside():
    with netns.Net() as net:
        public = net.host("public")
        router = net.nat_router()
        home = net.host("home", behind=router)
        assert home.ip.startswith(router.lan_subnet + ".")
        server = serve(public, 9000, size=10)
        assert home.call(fetch, public.ip, 9000) == 10
        assert server.stdout.readline().strip() == router.wan_ip  # masqueraded
        serve(home, 9001)
        # from the segment: no route to the home network, and the router's own address accepts nothing
        with pytest.raises(OSError):
            public.call(fetch, home.ip, 9001, 1.0)
        with pytest.raises(OSError):
            public.call(fetch, router.wan_ip, 9001, 1.0)
        # a second home behind the same router reaches the first directly (one home network)
        neighbour = net.host("neighbour", behind=router)
        assert neighbour.call(fetch, home.ip, 9001) == 0


def test_rate_limit_bounds_throughput_both_ways():
    size = 1_500_000  # 12 Mbit: at least 1.5 s at 8 Mbit/s, past tbf's burst many times over
    with netns.Net() as net:
        slow, fast = net.host("slow", rate_mbit=8), net.host("fast")
        serve(fast, 9000, size=size)
        serve(slow, 9001, size=size)
        for sender, receiver, port in ((fast, slow, 9000), (slow, fast, 9001)):  # slow's download, then upload
            start = time.monotonic()
            assert receiver.call(fetch, sender.ip, port) == size
            elapsed = time.monotonic() - start
            assert elapsed > 0.8 * size * 8 / 8e6, f"{size} bytes in {elapsed:.2f}s: faster than 8 Mbit/s"


def test_nothing_outlives_a_net_and_leftovers_are_reaped():
    with netns.Net() as net:
        a = net.host("a")
        sleeper = a.popen(["sleep", "600"])
        assert len(our_namespaces(net)) == 2  # the segment and a
    assert our_namespaces(net) == []
    assert sleeper.poll() is not None
    # a namespace of a run whose process is gone (killed before it could clean up) is removed by the next Net
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = f"{netns.PREFIX}-{dead.pid}-{'0' * 6}-h-orphan"
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    try:
        with netns.Net():
            assert orphan not in netns._netns_names()
    finally:
        subprocess.run(["ip", "netns", "del", orphan], capture_output=True)


def test_unavailable_reason_is_none_here():
    assert netns.unavailable_reason() is None
