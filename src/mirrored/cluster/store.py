"""Where the processes of a job meet: rank 0's rendezvous store, bound to one address only, and
the loopback binding of gloo's (or TensorPipe's) sockets.

Used by the workers' process group (:mod:`mirrored.comm.worker_group`), the parameter-server cluster
(:mod:`mirrored.parameter_server.rpc_cluster`) and the launcher (:mod:`mirrored.launch.launcher`).
The rendezvous is unauthenticated: on a cluster, keep its address on a private network.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from mirrored.cluster.resolvers import ClusterResolver

__all__ = ["connect_store", "host_store", "loopback_interface", "sockets_on_loopback"]


def connect_store(
    resolver: ClusterResolver, timeout: datetime.timedelta
) -> tuple[dist.TCPStore, tuple[str, int]]:
    """Rank 0 hosts the rendezvous store (unless a launcher's agent does); the others connect."""
    host, port = resolver.master_addr, resolver.master_port
    if resolver.rank != 0 or resolver.agent_store:
        if port == 0:
            raise ValueError(
                f"worker {resolver.rank} of {resolver.world_size} needs the rendezvous port of "
                "rank 0 (MASTER_PORT, or the chief's address in TF_CONFIG); got port 0"
            )
        return dist.TCPStore(host, port, resolver.world_size, False, timeout=timeout), (host, port)
    return host_store(host, port, resolver.world_size, timeout)


def host_store(
    host: str, port: int, num_clients: int | None, timeout: datetime.timedelta
) -> tuple[dist.TCPStore, tuple[str, int]]:
    """A rendezvous store hosted by this process on a socket bound to ``host`` only, never on
    every interface (TCPStore on its own binds the wildcard address); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError as error:
        listener.close()
        raise OSError(
            f"rank 0 cannot listen on {host}:{port} for the rendezvous ({error}); choose a free "
            "port (MASTER_PORT, or the chief's port in TF_CONFIG) on an address of this machine"
        ) from error
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        num_clients,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    return store, (host, port)


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS): GLOO_SOCKET_IFNAME."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@contextmanager
def sockets_on_loopback(
    host: str, variables: tuple[str, ...] = ("GLOO_SOCKET_IFNAME",)
) -> Iterator[None]:
    """Bind gloo's (or TensorPipe's: ``TP_SOCKET_IFNAME``) sockets to the loopback interface when
    the rendezvous is on loopback (they otherwise bind the address the machine's hostname
    resolves to); a variable the user set is left alone."""
    name = loopback_interface()
    chosen = [v for v in variables if v not in os.environ]
    if not _is_loopback(host) or name is None:
        chosen = []
    os.environ.update(dict.fromkeys(chosen, name or ""))
    try:
        yield
    finally:
        for variable in chosen:
            del os.environ[variable]
