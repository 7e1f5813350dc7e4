"""A set's rendezvous port is held from the moment its number is given out until rank 0's store serves it."""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import pytest

from hfplan.executor.worker import listening_socket


def test_the_port_given_out_cannot_be_taken_by_another_socket():
    listener = listening_socket("127.0.0.1")
    try:
        port = listener.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        listener.close()


def test_rank_zero_s_store_serves_on_the_socket_it_was_handed():
    dist = pytest.importorskip("torch.distributed")
    listener = listening_socket("127.0.0.1")
    port = listener.getsockname()[1]
    timeout = timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout, wait_for_workers=False,
                           master_listen_fd=listener.detach())
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    client.set("joined", b"rank 1")
    assert server.get("joined") == b"rank 1"
    assert server.port == port
