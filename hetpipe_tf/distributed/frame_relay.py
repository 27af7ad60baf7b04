"""The delay of emulated links (:mod:`hetpipe_tf.distributed.netlinks`): a process that holds every
frame a node sends for the link's latency before it reaches the bridge.

Run as a script in the wire namespace, isolated (``python -I -S frame_relay.py LATENCY_S WIRE PORT
...``): it imports the standard library only, so that it starts quickly and nothing of the package
or the environment runs inside the namespace.
"""
import ctypes
import os
import select
import socket
import sys
import time
from collections import deque

# AF_PACKET options (linux/if_packet.h), which the socket module does not name.
_SOL_PACKET = 263
_PACKET_VNET_HDR = 15          # each frame comes with a virtio_net_hdr, see _relay
_PACKET_IGNORE_OUTGOING = 23
_ETH_P_ALL = 0x0003
_SO_RCVBUFFORCE = 33           # SO_RCVBUF above net.core.rmem_max (needs CAP_NET_ADMIN)
_PR_SET_TIMERSLACK = 29        # linux/prctl.h


def relay(latency_s: float, pairs: list[tuple[str, str]]) -> None:
    """The delay of every link, run in the wire namespace by :meth:`hetpipe_tf.distributed.netlinks.EmulatedLinks.start`:
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
    relay(float(sys.argv[1]), list(zip(sys.argv[2::2], sys.argv[3::2])))
