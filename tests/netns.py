"""Real network namespaces for tests and benches: hosts on a shared segment, hosts behind a NAT router, bandwidth
limits, and commands run inside them.

    with Net() as net:
        a = net.host("a", rate_mbit=20)          # a namespace on the shared segment ("the internet"), 10.77.0.x
        router = net.nat_router()               # a home router: masquerade, no inbound connections
        home = net.host("home", behind=router)  # 192.168.n.x; reaches the segment only through the router's NAT
        proc = home.popen(["python", "-m", "http.server"])
        a.run(["ping", "-c1", home.ip])          # fails: nothing routes to a home network from outside
        a.call(urlopen, f"http://{b.ip}:8000/")  # a Python callable run in a's namespace, from this process

Layout. Everything lives in namespaces this harness creates, never in the caller's: the segment is a Linux bridge in
a namespace of its own (`<prefix>-wan`), each host a namespace with one veth (`eth0`) whose other end is a port of
that bridge. A NAT router is a namespace with one leg on the segment (`wan0`) and a bridge of its own (`lan0`) for
the hosts behind it; it forwards and masquerades lan -> wan and lets back in only what conntrack knows (a home
router). Because every address is inside these namespaces, fixed subnets never collide with another run's or the
machine's own.

Rates: `rate_mbit` puts a tbf qdisc on both ends of a host's veth, so upload and download are limited each to it;
`net.limit(host, rate_mbit)` does the same later to a host made without one.

Names: every namespace is `dtn-<pid>-<tag>-<role>`. A `Net` removes its namespaces, and kills the processes it left
in them, on exit (also on an exception); `reap()` (run at every `Net()` start, and by `python -m tests.netns`)
removes those of harness runs whose process is gone, e.g. killed with SIGKILL.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

PREFIX = "dtn"
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-\S+$")
WAN_SUBNET = "10.77.0"  # the shared segment, /24; hosts from .10, routers from .200
CLONE_NEWNET = 0x40000000
_CMD_TIMEOUT_S = 20.0


class NetnsError(RuntimeError):
    """A namespace, link, qdisc or firewall command failed; the message has the command and its stderr."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _sh(["ip", *args], check=check)


def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and out.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def unavailable_reason() -> Optional[str]:
    """None where namespaces, veth, bridges, tbf and iptables NAT all work here; else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (this runs as uid %d)" % os.geteuid()
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package {package}; `make setup` installs it as root)"
    probe = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:6]}-probe"
    try:
        _ip("netns", "add", probe)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {e}"
    try:
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _ip("-n", probe, "link", "set", "v0", "master", "br0")
        _sh(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "v1", "root", "tbf", "rate", "8mbit",
             "burst", "16kb", "latency", "100ms"])
        _sh(["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "v1", "-j",
             "MASQUERADE"])
    except NetnsError as e:
        return f"the kernel lacks a piece this harness needs (bridge, veth, tbf or NAT masquerade): {e}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def available() -> bool:
    return unavailable_reason() is None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _kill_inside(ns: str, grace_s: float = 5.0) -> None:
    """SIGKILL the processes left in one of this harness's namespaces (started there by the harness's caller), torch's
    shared-memory managers last: each unlinks its clients' tensors (/dev/shm/torch_*) once they are gone and exits by
    itself; killed with them, it leaks those files (gigabytes over a suite)."""
    def pids() -> list[int]:
        out = _ip("netns", "pids", ns, check=False)
        return [int(p) for p in out.stdout.split() if p.isdigit()]

    def kill(victims) -> None:
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    kill(pid for pid in pids() if not is_shm_manager(pid))
    deadline = time.monotonic() + grace_s
    while pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    kill(pids())


def is_shm_manager(pid: int) -> bool:
    """Whether `pid` is a torch_shm_manager (its /proc comm: the first 15 characters of the name)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == "torch_shm_manag"
    except OSError:
        return False


def reap() -> list[str]:
    """Remove the namespaces of harness runs whose process is gone; returns their names."""
    reaped = []
    for ns in _netns_names():
        m = _NAME_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
            reaped.append(ns)
    return reaped


_libc = ctypes.CDLL(None, use_errno=True)


def enter(ns: str) -> None:
    """Move the calling thread (only it) into namespace `ns`; sockets it opens afterwards live there. In a process of
    one thread, that is the process (tests.forkserver forks nodes into a namespace so)."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class Namespace:
    """One network namespace of a Net; commands, processes and Python callables run inside it."""

    net: "Net" = field(repr=False)
    ns: str = ""  # the namespace's name (ip netns)
    ip: str = ""  # its address on the segment or its home network ("" for the segment itself)
    port: tuple[str, str] = ()  # a host's veth's other end: (the switch's namespace, the port's name)

    def cmd(self, argv: Sequence[str]) -> list[str]:
        """`argv` prefixed to run inside the namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, argv: Sequence[str], check: bool = True, timeout_s: float = 60.0,
            **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.cmd(argv), check=check, timeout=timeout_s, **kwargs)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """A process inside the namespace; killed at the Net's exit if still running."""
        proc = subprocess.Popen(self.cmd(argv), **kwargs)
        self.net.adopt(proc)
        return proc

    def call(self, fn: Callable[..., Any], *args, timeout_s: float = 60.0, **kwargs) -> Any:
        """fn(*args, **kwargs) in a thread of this process that has entered the namespace; returns or raises what
        fn does. The thread ends with the call, so no other thread ever changes namespace."""
        result: dict[str, Any] = {}

        def body():
            try:
                enter(self.ns)
                result["value"] = fn(*args, **kwargs)
            except BaseException as e:  # handed to the caller
                result["error"] = e

        t = threading.Thread(target=body, daemon=True, name=f"netns-{self.ns}")
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} in {self.ns} still running after {timeout_s:.0f}s")
        if "error" in result:
            raise result["error"]
        return result["value"]


@dataclass
class Router(Namespace):
    """A NAT router: `wan_ip` on the segment, `lan_subnet`.1 for the hosts behind it."""

    wan_ip: str = ""
    lan_subnet: str = ""  # a.b.c, /24
    _next_host: int = 10


@dataclass
class Net:
    """A set of namespaces that exists for one `with` block. See the module docstring."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    _made: list[str] = field(default_factory=list)  # namespaces, in creation order
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _wan: Optional[Namespace] = None
    _next_host: int = 10
    _next_router: int = 200
    _next_port: int = 0
    _routers: int = 0

    def __enter__(self) -> "Net":
        reason = unavailable_reason()
        if reason:
            raise NetnsError(reason)
        reap()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def adopt(self, proc) -> None:
        """`proc` (a subprocess.Popen, or what tests.forkserver gives) runs in one of these namespaces: killed at
        close if still running."""
        self._procs.append(proc)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self._made):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def _name(self, role: str) -> str:
        return f"{PREFIX}-{os.getpid()}-{self.tag}-{role}"

    def _namespace(self, role: str) -> str:
        ns = self._name(role)
        if ns in self._made:
            raise NetnsError(f"this Net already has a namespace named {role!r}")
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def bridge(self) -> Namespace:
        """The shared segment (created on first use): a bridge `br0` in a namespace of its own."""
        if self._wan is None:
            ns = self._namespace("wan")
            _ip("-n", ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", ns, "link", "set", "br0", "up")
            self._wan = Namespace(self, ns)
        return self._wan

    def _port(self) -> str:
        self._next_port += 1
        return f"p{self._next_port}"

    def _plug(self, ns: str, ifname: str, switch_ns: str, switch: str, rate_mbit: Optional[float]) -> str:
        """A veth from `ns` (named `ifname` there) to a new port of bridge `switch` in `switch_ns`; returns the
        port's name."""
        port = self._port()
        _ip("link", "add", ifname, "netns", ns, "type", "veth", "peer", "name", port, "netns", switch_ns)
        _ip("-n", switch_ns, "link", "set", port, "master", switch, "up")
        _ip("-n", ns, "link", "set", ifname, "up")
        if rate_mbit is not None:
            self._limit(ns, ifname, rate_mbit)      # upload
            self._limit(switch_ns, port, rate_mbit)  # download
        return port

    @staticmethod
    def _limit(ns: str, dev: str, rate_mbit: float) -> None:
        if not 0 < rate_mbit <= 100_000:
            raise ValueError(f"rate_mbit {rate_mbit} is not in (0, 100000]")
        rate_bytes_s = rate_mbit * 1e6 / 8
        burst = max(16 * 1024, int(rate_bytes_s / 100))  # 10 ms of traffic, at least a few MTUs
        _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
             f"{int(rate_mbit * 1000)}kbit", "burst", str(burst), "latency", "200ms"])

    def host(self, name: str, rate_mbit: Optional[float] = None, behind: Optional[Router] = None) -> Namespace:
        """A namespace with one interface, `eth0`: on the segment (an address 10.77.0.x, no default route: the
        segment is all there is), or behind `behind`'s NAT (its home network, default route via the router)."""
        ns = self._namespace(f"h-{name}")
        if behind is None:
            wan = self.bridge()
            ip = f"{WAN_SUBNET}.{self._next_host}"
            self._next_host += 1
            if self._next_host >= 200:
                raise NetnsError("no more segment addresses")
            port = (wan.ns, self._plug(ns, "eth0", wan.ns, "br0", rate_mbit))
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        else:
            ip = f"{behind.lan_subnet}.{behind._next_host}"
            behind._next_host += 1
            port = (behind.ns, self._plug(ns, "eth0", behind.ns, "lan0", rate_mbit))
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _ip("-n", ns, "route", "add", "default", "via", f"{behind.lan_subnet}.1")
        return Namespace(self, ns, ip, port)

    def limit(self, host: Namespace, rate_mbit: float) -> None:
        """Shape the link of `host`, made without a rate, to `rate_mbit` both ways from now on."""
        switch_ns, port = host.port
        self._limit(host.ns, "eth0", rate_mbit)
        self._limit(switch_ns, port, rate_mbit)

    def nat_router(self, name: str = "nat") -> Router:
        """A home router on the segment: hosts behind it (`host(..., behind=router)`) reach the segment with the
        router's address (masquerade); from the segment nothing reaches them but replies to their connections."""
        wan = self.bridge()
        ns = self._namespace(f"r-{name}")
        self._routers += 1
        wan_ip = f"{WAN_SUBNET}.{self._next_router}"
        self._next_router += 1
        lan = f"192.168.{self._routers}"
        self._plug(ns, "wan0", wan.ns, "br0", None)
        _ip("-n", ns, "addr", "add", f"{wan_ip}/24", "dev", "wan0")
        _ip("-n", ns, "link", "add", "lan0", "type", "bridge")
        _ip("-n", ns, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _ip("-n", ns, "link", "set", "lan0", "up")
        ipt = ["ip", "netns", "exec", ns, "iptables"]
        _sh(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        _sh([*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE"])
        _sh([*ipt, "-P", "FORWARD", "DROP"])
        _sh([*ipt, "-A", "FORWARD", "-i", "lan0", "-j", "ACCEPT"])  # out, and within the home (br_netfilter)
        _sh([*ipt, "-A", "FORWARD", "-i", "wan0", "-o", "lan0", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT"])
        # nothing listens on the router itself: inbound connections to its address are refused or dropped
        return Router(self, ns, wan_ip, wan_ip=wan_ip, lan_subnet=lan)


if __name__ == "__main__":
    for name in reap():
        print("removed", name)
