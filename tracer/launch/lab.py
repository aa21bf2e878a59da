"""A cluster on one machine: N "nodes" as network namespaces, each joined to a switch
(a bridge in a namespace of its own) by a link whose egress is shaped, both ways, by a
token bucket (``tc qdisc ... tbf``).

What is emulated: each node's own network stack and address, and the bandwidth of its
link, so that gloo between nodes crosses a link of RATE (between ranks of one node it
stays inside the node, as on a real one). What is not: latency (``netem`` is not
available on these machines; ``tbf``'s ``latency`` only bounds its queue), switch
topology and oversubscription, NVLink, RDMA.

Everything is named ``ddpscope-<pid>-...`` (namespaces) or ``dsl<pid>...`` (links while
in the root namespace), ``pid`` the launcher's: ``Lab`` removes what it made when its
``with`` block ends, whatever ended it, and a later ``Lab`` removes what a launcher that
was killed left (its pid no longer alive). Needs ``ip`` and ``tc`` (iproute2) and root
or CAP_NET_ADMIN. Torch-free.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

#: "100mbit", "1gbit", "2.5gbit", "500kbit": the rates ``--link`` takes (tc's units, bits per second)
RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_UNIT = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
MIN_RATE_BPS, MAX_RATE_BPS = 1e6, 100e9
SUBNET = "10.97.0"  # inside the lab's namespaces only: it never meets the machine's own addresses
IFACE = "lab0"  # each node's interface, inside its namespace (what GLOO_SOCKET_IFNAME names)
PORT = 29500  # the rendezvous port on node 0: a fresh namespace has every port free
_NS_RE = re.compile(r"^ddpscope-(\d+)-")
_LINK_RE = re.compile(r"^dsl(\d+)[np]\d+")
CAP_NET_ADMIN = 12


def parse_rate(text: str) -> float:
    """``"1gbit"`` -> 1e9 (bit/s); ``ValueError`` on anything else, or out of 1 Mbit/s..100 Gbit/s."""
    m = RATE_RE.match(str(text).strip().lower())
    if not m:
        raise ValueError(f"must be a rate such as 100mbit, 1gbit or 10gbit, got {text!r}")
    bps = float(m.group(1)) * _UNIT[m.group(2)]
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ValueError(f"must be from 1mbit to 100gbit, got {text!r}")
    return bps


def why_not() -> str | None:
    """Why this process cannot build a lab (None: it can)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated nodes need iproute2's {' and '.join(missing)} (apt-get install iproute2)"
    try:
        with open("/proc/self/status") as f:
            caps = int(next(line.split()[1] for line in f if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        caps = 0
    if not caps >> CAP_NET_ADMIN & 1:  # root has it, unless it was dropped
        return "emulated nodes need root or CAP_NET_ADMIN (network namespaces, links and qdiscs)"
    return None


def burst_bytes(rate_bps: float) -> int:
    """The token bucket of a link of ``rate_bps``: 64 KiB, or a 250 Hz timer tick's worth
    of bytes when more (tbf needs that to keep its rate up)."""
    return max(64 * 1024, int(rate_bps / 8 / 250))


@dataclass(frozen=True)
class LabNode:
    index: int
    namespace: str
    address: str

    def prefix(self) -> list[str]:
        """What runs a command inside this node."""
        return ["ip", "netns", "exec", self.namespace]


class Lab:
    """``with Lab(nodes, rate) as lab:`` the namespaces, links and qdiscs exist inside the
    block and are gone after it (``OSError`` with ``ip``'s or ``tc``'s words if they
    cannot be made: what was made is removed first)."""

    def __init__(self, nodes: int, rate: str) -> None:
        if not 2 <= nodes <= 64:
            raise ValueError(f"--emulate-nodes must be in 2..64, got {nodes}")
        self.rate = str(rate).strip().lower()
        self.rate_bps = parse_rate(self.rate)
        self.tag = str(os.getpid())
        self.switch = f"ddpscope-{self.tag}-switch"
        self.nodes = [LabNode(k, f"ddpscope-{self.tag}-node{k}", f"{SUBNET}.{k + 1}") for k in range(nodes)]
        self._made: list[str] = []

    @property
    def burst_bytes(self) -> int:
        """The token bucket's size: what a link sends at once, beyond its rate, after an idle
        spell (tbf needs at least a timer tick's worth of bytes to keep its rate up)."""
        return burst_bytes(self.rate_bps)

    @property
    def endpoint(self) -> str:
        """The rendezvous endpoint: node 0's address."""
        return f"{self.nodes[0].address}:{PORT}"

    def env(self) -> dict[str, str]:
        """What each node's ranks need: gloo bound to the lab's interface, and to know that
        their nodes are emulated (ddpscope's jobs then stay on gloo: see workloads/worker.py)."""
        from ddpscope.tracer.workloads.worker import EMULATED_ENV

        return {"GLOO_SOCKET_IFNAME": IFACE, EMULATED_ENV: "1"}

    def __enter__(self) -> "Lab":
        reason = why_not()
        if reason:
            raise PermissionError(reason)
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _build(self) -> None:
        shape = ["root", "tbf", "rate", self.rate, "burst", str(self.burst_bytes), "latency", "50ms"]
        self._netns_add(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            self._netns_add(node.namespace)
            near, far = f"dsl{self.tag}n{node.index}", f"dsl{self.tag}p{node.index}"
            _run("ip", "link", "add", near, "type", "veth", "peer", "name", far)
            _run("ip", "link", "set", near, "netns", node.namespace)
            _run("ip", "link", "set", far, "netns", self.switch)
            ns = node.namespace
            _run("ip", "-n", ns, "link", "set", near, "name", IFACE)
            _run("ip", "-n", ns, "addr", "add", f"{node.address}/24", "dev", IFACE)
            _run("ip", "-n", ns, "link", "set", IFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", self.switch, "link", "set", far, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", far, "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFACE, *shape)  # node -> switch
            _run("ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", far, *shape)  # switch -> node

    def _netns_add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def remove(self) -> None:
        """Remove what this lab made (a namespace takes its links and qdiscs with it)."""
        for name in reversed(self._made):
            _ip_quiet("netns", "del", name)
        self._made.clear()
        for link in _links():  # a pair not yet moved into its namespaces
            if link.startswith(f"dsl{self.tag}"):
                _ip_quiet("link", "del", link)


def sweep_stale() -> list[str]:
    """Remove the namespaces and links of labs whose launcher is gone; what was removed."""
    gone = []
    try:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return gone
    for name in names:
        m = _NS_RE.match(name)
        if m and not _alive(int(m.group(1))):
            _ip_quiet("netns", "del", name)
            gone.append(name)
    for link in _links():
        m = _LINK_RE.match(link)
        if m and not _alive(int(m.group(1))):
            _ip_quiet("link", "del", link)
            gone.append(link)
    return gone


def lab_leftovers() -> list[str]:
    """Every namespace and root-namespace link of any lab, alive or not (for tests)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
    return [n for n in names if _NS_RE.match(n)] + [link for link in _links() if _LINK_RE.match(link)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _links() -> list[str]:
    try:
        out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(f"cannot build the emulated nodes: `{' '.join(cmd)}`: {r.stderr.strip() or r.returncode}")


def _ip_quiet(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
