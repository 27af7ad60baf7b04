"""Emulated links between the nodes of a cluster, all on one machine (Linux, root).

HetPipe (USENIX ATC 2020, §8) trains on nodes joined by a network of a given bandwidth and
latency (e.g. 1 Gbit/s and 0.5 ms). :class:`EmulatedLinks` gives each node a network
namespace of its own, joined to the others so that one rule holds:

    every frame a node sends waits in a queue drained at ``bandwidth_bps``, then takes
    ``latency_s`` to arrive; frames into a node are not shaped again.

So node A -> node B is shaped once (by A's link) and B -> A once (by B's): a round trip
between two nodes takes at least ``2 * latency_s``, and a bulk transfer runs at
``bandwidth_bps`` (counted in Ethernet frames, so TCP's payload gets about 95% of it). The
chief stays in the root namespace and reaches every node through a bridge there: its frames
to a node are not shaped, the node's answers are.

Topology of an instance whose names start with ``hp3`` (node ``i``; every name starts
with the prefix, so that instances never collide)::

    node namespace hp3n<i>  lo, eth0 10.a.b.<i+2>/24; egress: tbf at bandwidth_bps
                              | veth
    wire namespace hp3w     w<i> --relay, after latency_s--> p<i>     (from the node)
                            w<i> <--tc mirred, at once------ p<i>     (to the node)
                                                              | veth
    root namespace          hp3p<i>, a port of bridge hp3br, 10.a.b.1/24 (the chief)

Why not netem: ``tc qdisc add dev eth0 root netem delay 5ms rate 20mbit`` would do the
whole rule in one qdisc, but netem is an optional part of the kernel (CONFIG_NET_SCH_NETEM)
that kernels built for VMs and CI machines often leave out (this project's test machine has
none), while tbf is nearly always built in. So tbf limits the rate, and the delay is a relay
process (:mod:`hetpipe_tf.distributed.frame_relay`, run as a script) that reads every frame a node sends
from ``w<i>`` and writes it to ``p<i>`` ``latency_s`` later; frames to the node skip it.

A process killed with its links up leaves them behind (the relay ends with it); later
instances pick other names and subnets, and ``ip netns del`` of the namespaces and
``ip link del <prefix>br`` remove them.
"""
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence

from hetpipe_tf.distributed import frame_relay
from hetpipe_tf.errors import HetPipeRunError

_LOCK_PATH = "/run/hetpipe-netlinks.lock"
_FIRST_SUBNET = ipaddress.ip_network("10.200.0.0/24")
_SLOTS = 56 * 256  # the subnets 10.200.0.0/24 ... 10.255.255.0/24, one per instance
_MAX_NODES = 253   # 10.a.b.2 ... 10.a.b.254
_MAX_NAME = 15     # the kernel's limit on an interface's name



class NetLinksError(HetPipeRunError, RuntimeError):
    """The emulated links cannot be made here, or an ``ip``/``tc`` command failed."""


def _run(argv: Sequence[str]) -> str:
    """Runs an ``ip`` or ``tc`` command and returns its output; raises NetLinksError with the
    command and its stderr if it fails.

    Returns:
        Its output.

    Raises:
        NetLinksError: the command failed.
    """
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetLinksError(f"`{shlex.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _subnet(slot: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network((int(_FIRST_SUBNET.network_address) + (slot << 8), 24))


def _free_slot() -> int:
    """The first slot that no instance here holds: no namespace or interface is named like
    its names (``hp<slot>`` and a letter; a crashed run may have left some) and no route
    overlaps its subnet. Call it under the host-wide lock, and claim the slot under it.

    Returns:
        The slot.

    Raises:
        NetLinksError: every slot is taken.
    """
    names = [ns["name"] for ns in json.loads(_run(["ip", "-j", "netns", "list"]) or "[]")]
    names += [link["ifname"] for link in json.loads(_run(["ip", "-j", "link", "show"]))]
    routes = [ipaddress.ip_network(route["dst"], strict=False)
              for route in json.loads(_run(["ip", "-j", "-4", "route", "show"]))
              if route["dst"] != "default"]
    for slot in range(_SLOTS):
        taken = re.compile(rf"hp{slot}[a-z]")
        if not any(taken.match(name) for name in names) and not any(
                _subnet(slot).overlaps(route) for route in routes):
            return slot
    raise NetLinksError(f"every subnet from {_FIRST_SUBNET} on is in use by routes or other links")


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """Held while an instance picks its slot and claims it (its bridge, with the slot's
    subnet), so that processes starting links at the same time pick different slots."""
    with open(_LOCK_PATH, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


class EmulatedLinks:
    """``num_nodes`` network namespaces joined by links of ``bandwidth_bps`` (bits/s) and
    ``latency_s`` (seconds) each way, with the rule and topology of this module's docstring.

    ``prefix`` starts every name the links create (namespaces ``<prefix>n<i>``, bridge
    ``<prefix>br``, ...); by default it is ``hp<slot>``, free on this machine.

    Use it as a context manager, or call :meth:`start` and :meth:`stop`::

        with EmulatedLinks(4, 1e9, 0.0005) as links:
            subprocess.Popen(links.command(0, ["python", "server.py", links.address(0)]))
    """

    def __init__(self, num_nodes: int, bandwidth_bps: float, latency_s: float, prefix: str | None = None) -> None:
        if not isinstance(num_nodes, int) or not 1 <= num_nodes <= _MAX_NODES:
            raise ValueError(f"num_nodes must be an integer from 1 to {_MAX_NODES} "
                             f"(each node has an address in one /24 subnet), got {num_nodes!r}")
        if not bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be > 0 (bits per second), got {bandwidth_bps!r}")
        if not latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0 (seconds), got {latency_s!r}")
        longest = max(len("br"), len(f"p{num_nodes - 1}"))
        if prefix is not None and not (re.fullmatch("[a-z][a-z0-9]*", prefix)
                                       and len(prefix) + longest <= _MAX_NAME):
            raise ValueError(f"prefix must be lowercase letters and digits, starting with a letter, "
                             f"at most {_MAX_NAME - longest} characters for {num_nodes} nodes "
                             f"(interface names have at most {_MAX_NAME}), got {prefix!r}")
        self.num_nodes = num_nodes
        self.bandwidth_bps = bandwidth_bps
        self.latency_s = latency_s
        self._given_prefix = prefix
        self._prefix: str | None = None  # chosen by start()
        self._subnet: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None  # chosen by start()
        self._undo: list[Sequence[str]] = []  # commands that remove what start() made, in the order made
        self._relay: subprocess.Popen[str] | None = None

    def start(self) -> "EmulatedLinks":
        """Creates the namespaces and links, and returns self once traffic can flow. Raises
        NetLinksError (having removed what it made) if they cannot be made here.

        Returns:
            Self.

        Raises:
            NetLinksError: the links cannot be made here (what was made is removed).
        """
        if os.geteuid() != 0:
            raise NetLinksError("emulated links need root (network namespaces and tc need "
                                "CAP_NET_ADMIN and CAP_SYS_ADMIN): run as root, or run without "
                                "emulated links (the nodes then talk over loopback, unshaped)")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NetLinksError(f"emulated links need the `{tool}` command (iproute2), which is not "
                                    f"on PATH: install iproute2, or run without emulated links")
        try:
            self._create()
        except BaseException:
            self.stop()
            raise
        return self

    def _do(self, argv: Sequence[str], undo: Sequence[str] | None = None) -> None:
        _run(argv)
        if undo is not None:
            self._undo.append(undo)

    def _create(self) -> None:
        with _host_lock():
            slot = _free_slot()
            self._prefix = self._given_prefix or f"hp{slot}"
            self._subnet = _subnet(slot)
            bridge = self._prefix + "br"
            self._do(["ip", "link", "add", bridge, "type", "bridge"], undo=["ip", "link", "del", bridge])
            self._do(["ip", "addr", "add", f"{self.chief_address}/24", "dev", bridge])
            self._do(["ip", "link", "set", bridge, "up"])
        wire = self._prefix + "w"
        self._do(["ip", "netns", "add", wire], undo=["ip", "netns", "del", wire])
        # The bucket holds at least two full frames (1514 bytes at MTU 1500), or 1 ms of
        # traffic: that bounds how far the link may run ahead of its rate, and from 512
        # Mbit/s on lets TCP's 64 KB GSO frames through whole (tbf cuts a GSO frame larger
        # than its bucket into 1514-byte frames), so that the relay copies few large frames.
        burst = max(2 * 1514, round(self.bandwidth_bps / 8 * 1e-3))
        for i in range(self.num_nodes):
            node, port = self.namespace(i), f"{self._prefix}p{i}"
            self._do(["ip", "netns", "add", node], undo=["ip", "netns", "del", node])
            self._do(["ip", "link", "add", "eth0", "netns", node, "type", "veth",
                      "peer", "name", f"w{i}", "netns", wire])
            self._do(["ip", "link", "add", port, "type", "veth", "peer", "name", f"p{i}", "netns", wire],
                     undo=["ip", "link", "del", port])
            self._do(["ip", "link", "set", port, "master", self._prefix + "br", "up"])
            for ns, link in [(node, "lo"), (node, "eth0"), (wire, f"w{i}"), (wire, f"p{i}")]:
                self._do(["ip", "-n", ns, "link", "set", link, "up"])
            self._do(["ip", "-n", node, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
            # A queue of up to 100 ms at the link's rate: a sender that outruns the link
            # loses frames, as it would at a switch.
            self._do(["tc", "-n", node, "qdisc", "add", "dev", "eth0", "root", "tbf",
                      "rate", f"{round(self.bandwidth_bps)}bit", "burst", str(burst), "latency", "100ms"])
            # Frames to the node go straight from p<i> to w<i>, in the kernel.
            self._do(["tc", "-n", wire, "qdisc", "add", "dev", f"p{i}", "ingress"])
            self._do(["tc", "-n", wire, "filter", "add", "dev", f"p{i}", "parent", "ffff:", "protocol", "all",
                      "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", f"w{i}"])
        pairs = [name for i in range(self.num_nodes) for name in (f"w{i}", f"p{i}")]
        self._relay = relay = subprocess.Popen(
            ["ip", "netns", "exec", wire, sys.executable, "-I", "-S", frame_relay.__file__,
             repr(self.latency_s), *pairs],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert relay.stdout is not None and relay.stderr is not None  # both piped
        if relay.stdout.readline().strip() != "ready":
            raise NetLinksError(f"the relay that delays frames did not start: {relay.stderr.read().strip()}")

    def stop(self) -> None:
        """Removes everything start() made. Safe to call twice, or after start() failed."""
        if self._relay is not None:
            self._relay.terminate()
            self._relay.communicate()
            self._relay = None
        while self._undo:
            # Best effort: a link may already be gone with its namespace.
            subprocess.run(self._undo.pop(), check=False, capture_output=True)

    def __enter__(self) -> "EmulatedLinks":
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _started(self, what: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        """The subnet start() chose; NetLinksError naming `what` before it ran."""
        if self._subnet is None:
            raise NetLinksError(f"{what} is known once start() has run")
        return self._subnet

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be from 0 to {self.num_nodes - 1}, got {node!r}")

    def namespace(self, node: int) -> str:
        """The name of node's network namespace."""
        self._check_node(node)
        self._started("a namespace's name")
        return f"{self._prefix}n{node}"

    def address(self, node: int) -> str:
        """Node's IPv4 address, on eth0 in its namespace."""
        self._check_node(node)
        return str(self._started("a node's address")[node + 2])

    @property
    def chief_address(self) -> str:
        """The bridge's IPv4 address in the root namespace: where the nodes reach the chief."""
        return str(self._started("the chief's address")[1])

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` in node's namespace (for subprocess)."""
        return ["ip", "netns", "exec", self.namespace(node), *argv]
