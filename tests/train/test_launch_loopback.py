"""Single-node launches of flashfsdp-train keep gloo's sockets on the loopback interface
(GLOO_SOCKET_IFNAME), unless the user chose an interface."""

from __future__ import annotations

import os
import socket

from flashfsdp.train import launch


def test_the_workers_get_the_loopback_interface(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    launch._worker_environment(2, "cpu")
    names = {name for _, name in socket.if_nameindex()}
    assert os.environ["GLOO_SOCKET_IFNAME"] == launch.loopback_interface() and os.environ["GLOO_SOCKET_IFNAME"] in names


def test_a_chosen_interface_is_kept(monkeypatch):
    monkeypatch.setattr(os, "environ", {**os.environ, "GLOO_SOCKET_IFNAME": "eth7"})
    launch._worker_environment(2, "cpu")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
