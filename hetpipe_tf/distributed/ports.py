"""Ports chosen now for tasks that bind them later (:func:`free_port`).

Standard library only: the baselines load this file by its path, outside the package.
"""
import random
import socket

#: Where the system reads the range it takes an outgoing connection's local port from.
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"

#: The draws of ports: the system's randomness, never Python's global generator, which a user's
#: seed (``keras.utils.set_random_seed``) governs and Keras draws its initializers' seeds from.
DRAW = random.SystemRandom()


def _ephemeral_start() -> int | None:
    """The first port of the system's ephemeral range, or None where it cannot be read."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A TCP port free on `host` now, for a task that binds it later (a TensorFlow server binds
    its port seconds after it is chosen, once TensorFlow is imported).

    The port is drawn at random below the system's ephemeral range (ports 10000 up to the range's
    start, where that leaves room), because the system gives an outgoing connection's local port from
    that range at any time: a port chosen in it can be taken by any process's connection before the
    task binds it. Where the range cannot be read or leaves no room below it, the system's choice.

    Returns:
        The port.
    """
    start = _ephemeral_start()
    if start is not None and start > 11000:
        for port in DRAW.sample(range(10000, start), min(tries, start - 10000)):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different ports free on `host` now, each as :func:`free_port`'s.

    Returns:
        The ports.
    """
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports
