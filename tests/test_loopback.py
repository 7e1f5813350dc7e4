"""Gloo's loopback scope: GLOO_SOCKET_IFNAME names the loopback interface inside it, and nothing after it."""

from __future__ import annotations

import os
import socket

import pytest

from hfplan.executor.loopback import gloo_on_loopback, loopback_interface


def test_the_loopback_interface_is_one_of_the_machines_interfaces():
    names = [name for _, name in socket.if_nameindex()]
    assert loopback_interface() in names
    assert loopback_interface() in ("lo", "lo0")


def test_gloo_uses_loopback_inside_the_scope_only(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with gloo_on_loopback():
        assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface()
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_an_interface_the_caller_chose_is_kept(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    with gloo_on_loopback():
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_the_scope_ends_on_an_error(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.raises(RuntimeError), gloo_on_loopback():
        raise RuntimeError("a failed init")
    assert "GLOO_SOCKET_IFNAME" not in os.environ
