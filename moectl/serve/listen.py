"""The listening socket of `moectl serve`, bound before the model loads so a busy port fails fast."""

from __future__ import annotations

import socket

from ..errors import MoectlError


def bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise MoectlError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)        # allow restarts over TIME_WAIT sockets only
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        hint = " (another server is listening there; pick another --port)" if e.errno == 98 else ""
        raise MoectlError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock
