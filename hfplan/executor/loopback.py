"""Gloo on one machine talks over the loopback interface: its name, and a scope in which gloo uses it."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface ("lo" on Linux, "lo0" on macOS), if it has one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name in ("lo", "lo0")), None)


@contextlib.contextmanager
def gloo_on_loopback() -> Iterator[None]:
    """Gloo process groups made meanwhile listen on the loopback interface only: torch's documented
    GLOO_SOCKET_IFNAME (unless the caller set it), which gloo reads as each group is created."""
    loopback = loopback_interface()
    if loopback is None or "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
