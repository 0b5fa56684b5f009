"""The rendezvous of the workers `flashfsdp-train` starts on this host, over TCP stores that
listen on 127.0.0.1 only.

torch's elastic launcher (what `torchrun --standalone` runs) hosts two TCP stores in the agent
process: the c10d rendezvous backend's, and the store it shares with the workers (their
MASTER_ADDR / MASTER_PORT, through which they build the process group). `torch.distributed.TCPStore`
binds its listening socket to every interface (0.0.0.0 / ::) whatever host name it is given, so
a one-host job would accept connections from the whole network. Here each store gets a socket
already bound to 127.0.0.1 and listening (`TCPStore(..., master_listen_fd=...)`): the rendezvous
backend `LOOPBACK_BACKEND`, registered in torch's rendezvous registry, is torch's own
`DynamicRendezvousHandler` over a `C10dRendezvousBackend`, with both stores made that way.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (DynamicRendezvousHandler,
                                                                      RendezvousTimeout)

LOOPBACK = "127.0.0.1"
# The name to pass as `LaunchConfig(rdzv_backend=...)`.
LOOPBACK_BACKEND = "flashfsdp-loopback"
# Seconds a store operation waits (torch's TCPStore default).
STORE_TIMEOUT_S = 300
# Pending connections a store's socket queues (one per local worker and the agent at most).
_BACKLOG = 128


def loopback_store() -> dist.TCPStore:
    """A new TCPStore server in this process, listening on a free port of 127.0.0.1 only.

    The socket is bound and listening before the store adopts it (`master_listen_fd`), so there
    is no window in which the port is free for someone else, and no other interface is bound.

    Raises:
        OSError: no loopback port could be bound.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(_BACKLOG)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # detach(): the store owns the descriptor from here on (the socket object must not close it).
    return dist.TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=STORE_TIMEOUT_S), master_listen_fd=sock.detach())


class _LoopbackRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, whose store shared with the workers listens on 127.0.0.1."""

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        return loopback_store()

    def get_backend(self) -> str:
        """`LOOPBACK_BACKEND`, the name this handler is registered under."""
        return LOOPBACK_BACKEND


def _create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """The handler of `LOOPBACK_BACKEND` (called by torch's registry; `params.endpoint` unused)."""
    store = loopback_store()
    backend = C10dRendezvousBackend(store, params.run_id)
    join = timedelta(seconds=params.get_as_int("join_timeout", 600))
    return _LoopbackRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, local_addr=LOOPBACK,
        timeout=RendezvousTimeout(join=join))


rendezvous_handler_registry.register(LOOPBACK_BACKEND, _create_handler)
