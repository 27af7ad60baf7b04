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
process (:func:`_relay`, this file run as a script) that reads every frame a node sends
from ``w<i>`` and writes it to ``p<i>`` ``latency_s`` later; frames to the node skip it.

A process killed with its links up leaves them behind (the relay ends with it); later
instances pick other names and subnets, and ``ip netns del`` of the namespaces and
``ip link del <prefix>br`` remove them.
"""
import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import re
import select
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections import deque

from hetpipe_tf.errors import HetPipeRunError

_LOCK_PATH = "/run/hetpipe-netlinks.lock"
_FIRST_SUBNET = ipaddress.ip_network("10.200.0.0/24")
_SLOTS = 56 * 256  # the subnets 10.200.0.0/24 ... 10.255.255.0/24, one per instance
_MAX_NODES = 253   # 10.a.b.2 ... 10.a.b.254
_MAX_NAME = 15     # the kernel's limit on an interface's name

# AF_PACKET options (linux/if_packet.h), which the socket module does not name.
_SOL_PACKET = 263
_PACKET_VNET_HDR = 15          # each frame comes with a virtio_net_hdr, see _relay
_PACKET_IGNORE_OUTGOING = 23
_ETH_P_ALL = 0x0003
_SO_RCVBUFFORCE = 33           # SO_RCVBUF above net.core.rmem_max (needs CAP_NET_ADMIN)
_PR_SET_TIMERSLACK = 29        # linux/prctl.h


class NetLinksError(HetPipeRunError, RuntimeError):
    """The emulated links cannot be made here, or an ``ip``/``tc`` command failed."""


def _run(argv):
    """Runs an ``ip`` or ``tc`` command and returns its output; raises NetLinksError with the
    command and its stderr if it fails."""
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetLinksError(f"`{shlex.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _subnet(slot):
    return ipaddress.ip_network((int(_FIRST_SUBNET.network_address) + (slot << 8), 24))


def _free_slot():
    """The first slot that no instance here holds: no namespace or interface is named like
    its names (``hp<slot>`` and a letter; a crashed run may have left some) and no route
    overlaps its subnet. Call it under the host-wide lock, and claim the slot under it."""
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
def _host_lock():
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

    def __init__(self, num_nodes, bandwidth_bps, latency_s, prefix=None):
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
        self._prefix = self._subnet = None  # chosen by start()
        self._undo = []      # commands that remove what start() made, in the order made
        self._relay = None

    def start(self):
        """Creates the namespaces and links, and returns self once traffic can flow. Raises
        NetLinksError (having removed what it made) if they cannot be made here."""
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

    def _do(self, argv, undo=None):
        _run(argv)
        if undo is not None:
            self._undo.append(undo)

    def _create(self):
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
        self._relay = subprocess.Popen(
            ["ip", "netns", "exec", wire, sys.executable, "-I", "-S", os.path.abspath(__file__),
             repr(self.latency_s), *pairs],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self._relay.stdout.readline().strip() != "ready":
            raise NetLinksError(f"the relay that delays frames did not start: {self._relay.stderr.read().strip()}")

    def stop(self):
        """Removes everything start() made. Safe to call twice, or after start() failed."""
        if self._relay is not None:
            self._relay.terminate()
            self._relay.communicate()
            self._relay = None
        while self._undo:
            # Best effort: a link may already be gone with its namespace.
            subprocess.run(self._undo.pop(), check=False, capture_output=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *_exc):
        self.stop()

    def _started(self, what):
        if self._subnet is None:
            raise NetLinksError(f"{what} is known once start() has run")

    def _check_node(self, node):
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be from 0 to {self.num_nodes - 1}, got {node!r}")

    def namespace(self, node):
        """The name of node's network namespace."""
        self._check_node(node)
        self._started("a namespace's name")
        return f"{self._prefix}n{node}"

    def address(self, node):
        """Node's IPv4 address, on eth0 in its namespace."""
        self._check_node(node)
        self._started("a node's address")
        return str(self._subnet[node + 2])

    @property
    def chief_address(self):
        """The bridge's IPv4 address in the root namespace: where the nodes reach the chief."""
        self._started("the chief's address")
        return str(self._subnet[1])

    def command(self, node, argv):
        """The argv that runs ``argv`` in node's namespace (for subprocess)."""
        return ["ip", "netns", "exec", self.namespace(node), *argv]


def _relay(latency_s, pairs):
    """The delay of every link, run in the wire namespace by :meth:`EmulatedLinks.start`:
    each frame that arrives on ``w<i>`` (sent by node i) leaves on ``p<i>`` (to the bridge)
    ``latency_s`` later. The delay is the same for every frame, so frames wait in one queue
    in arrival order, which is also the order they are due in. Ends when its stdin closes,
    so that it never outlives the process that started it.

    The sockets carry a virtio_net_hdr before each frame, as they got it: GSO frames (up
    to 64 KB of TCP segments) and frames whose checksum is still to be filled in pass
    unchanged, which a plain packet socket would refuse or leave with bad checksums.
    """
    queue = deque()  # (when due, socket it leaves on, virtio_net_hdr and frame)
    out = {}
    for wire, port in pairs:
        rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        rx.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        rx.setsockopt(_SOL_PACKET, _PACKET_IGNORE_OUTGOING, 1)  # frames mirred to the node
        rx.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 8 << 20)
        rx.bind((wire, _ETH_P_ALL))
        rx.setblocking(False)
        tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: sends only
        tx.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        tx.bind((port, 0))
        out[rx] = tx
    buffer = memoryview(bytearray(1 << 17))
    # Frames must leave on time even when training keeps every CPU busy: a real-time
    # priority wakes the relay as soon as a frame is due (without it, round trips grew by
    # up to 10 ms on a busy machine), and a timer slack of 1 us instead of 50 us keeps even
    # a 0.5 ms latency within a few percent.
    ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000))
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except PermissionError:  # e.g. a container without CAP_SYS_NICE: less exact under load
        pass
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, tx, frame = queue.popleft()
            try:
                tx.send(frame)
            except OSError:  # the bridge's backlog is full: the frame is lost, as on a real link
                pass
        timeout = queue[0][0] - now if queue else None
        readable, _, _ = select.select([sys.stdin, *out], [], [], timeout)
        due = time.monotonic() + latency_s
        for rx in readable:
            if rx is sys.stdin:
                return
            while True:
                try:
                    size = rx.recv_into(buffer)
                except BlockingIOError:
                    break
                queue.append((due, out[rx], buffer[:size].tobytes()))


if __name__ == "__main__":
    _relay(float(sys.argv[1]), list(zip(sys.argv[2::2], sys.argv[3::2])))
