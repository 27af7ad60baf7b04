"""Ports chosen for tasks that bind them later."""
import random
import socket

from hetpipe_tf.distributed import ports
from hetpipe_tf.distributed.ports import free_port, free_ports


def test_a_free_port_is_drawn_below_the_range_outgoing_connections_take_their_ports_from():
    """A task binds its port seconds after it is chosen; a port of the ephemeral range could be
    any connection's local port by then (a task once failed with "Could not start gRPC server")."""
    start = int(open(ports.EPHEMERAL_RANGE_FILE).read().split()[0])
    chosen = [free_port() for _ in range(50)]
    assert all(10000 <= p < start for p in chosen), chosen
    assert len(set(chosen)) > 40  # drawn at random, not the same port again


def test_a_taken_port_is_passed_over(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(ports.DRAW, "sample", lambda population, k: [port, 12345])
        assert free_port() == 12345


def test_without_room_below_the_ephemeral_range_the_system_chooses(tmp_path, monkeypatch):
    wide = tmp_path / "range"
    wide.write_text("1024\t65535\n")
    system_start = int(open(ports.EPHEMERAL_RANGE_FILE).read().split()[0])
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(wide))
    port = free_port()
    assert port >= system_start  # the system's choice, from its own range
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: it binds


def test_free_ports_are_different():
    chosen = free_ports(20)
    assert len(set(chosen)) == 20


def test_choosing_ports_leaves_pythons_random_generator_alone():
    """A user's seed governs it (Keras draws its initializers' seeds from it): a cluster started
    between the seed and the model must not change the model's initial weights."""
    random.seed(0)
    expected = random.random()
    random.seed(0)
    free_ports(5)
    assert random.random() == expected
