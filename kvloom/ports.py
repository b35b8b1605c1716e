"""Ports chosen here for a server that another process starts later.

A port found free by binding port 0 and closing it is free only until something else
binds it: any process asking the kernel for a port (a server on port 0, a TCP store) may
be handed the same one before our child binds it. ``reserve_ports`` closes the gap the
way Yelp's ephemeral-port-reserve does: it connects to the chosen port and closes the
accepted end first, which leaves that end in TIME_WAIT for the kernel's TIME_WAIT period
(60 s on Linux). While it is there the kernel hands the port to no one asking for port
0, and a server binding it by number with SO_REUSEADDR (uvicorn, kvloom's own sockets,
torch's TCP store) still gets it.
"""

from __future__ import annotations

import contextlib
import socket

__all__ = ["reserve_ports"]


def reserve_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports on ``host``, kept from the kernel's own choices for
    about a minute (module docstring): bind them by number within that time."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    family, kind, protocol, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with contextlib.ExitStack() as held:  # every listener open until all are chosen: they differ
        ports = []
        for _ in range(count):
            listener = held.enter_context(socket.socket(family, kind, protocol))
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(1)
            chosen = listener.getsockname()
            with socket.socket(family, kind, protocol) as client:
                client.connect(chosen)
                accepted, _ = listener.accept()
                accepted.close()  # the accepted end closes first: it is the one in TIME_WAIT
            ports.append(int(chosen[1]))
        return ports
