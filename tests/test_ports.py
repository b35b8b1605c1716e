"""kvloom.ports.reserve_ports: a chosen port stays out of the kernel's own choices and a
server that binds it by number (SO_REUSEADDR, as uvicorn and torch's TCP store do) gets it."""

from __future__ import annotations

import errno
import socket

import pytest

from kvloom.ports import reserve_ports


def test_reserved_ports_differ_and_are_held_from_plain_binds() -> None:
    ports = reserve_ports(3)
    assert len(set(ports)) == 3 and all(1024 <= port < 65536 for port in ports)
    for port in ports:
        # A bind without SO_REUSEADDR conflicts with the port's TIME_WAIT end: the rule by
        # which the kernel skips the port when anyone asks for port 0.
        with socket.socket() as plain, pytest.raises(OSError) as refused:
            plain.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE


def test_a_server_binding_the_port_by_number_gets_it() -> None:
    (port,) = reserve_ports(1)
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(1)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            accepted, _ = server.accept()
            with accepted:
                client.sendall(b"ping")
                assert accepted.recv(4) == b"ping"


def test_a_bad_count_is_refused_by_name() -> None:
    assert reserve_ports(0) == []
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        reserve_ports(-1)
