"""The data tests' offline guard and data directory: any socket connection or DNS look-up fails
the test, and the data directory must hold no downloaded file afterwards."""
import os
import socket

import pytest


@pytest.fixture(scope="module", autouse=True)
def no_network():
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket.socket, "connect_ex", refuse)
        mp.setattr(socket, "getaddrinfo", refuse)
        yield


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    yield path
    downloaded = [f for _, _, files in os.walk(path / "downloads") for f in files]
    assert downloaded == []

