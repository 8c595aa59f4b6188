"""The processes of a parameter-server job as one ``torch.distributed.rpc`` group.

``torch.distributed.rpc`` leaves three things to the user that this module settles once:

- **Where it listens.** Its rendezvous store would bind every interface and TensorPipe the address
  the host name resolves to; here the store listens only on the chief's address, and TensorPipe
  and gloo use the loopback interface when that address is a loopback one.
- **Its own store connection.** ``init_rpc`` resets its store's timeout, so RPC gets a client of
  its own rather than sharing one.
- **Ending.** A graceful ``rpc.shutdown()`` waits forever for a dead peer; this group always
  shuts down without that handshake, after its own end-of-job messages.

Security: like every ``torch.distributed`` primitive, RPC is unauthenticated and unpickles what
its peers send (a peer can run any code here). Keep every task of the job on a private network:
the defaults listen on 127.0.0.1 only.
"""

from __future__ import annotations

import datetime
import secrets
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
import torch.distributed.rpc as rpc

from mirrored.worker_group import host_store, sockets_on_loopback

__all__ = ["RpcCluster", "start_rpc"]

_SCHEME = "mirrored-rpc"
_handler_registered = False
_stores: dict[str, dist.Store] = {}  # the store handed to init_rpc, by the URL's "store"


@dataclass(frozen=True)
class RpcCluster:
    """Who is who in the RPC group: names in rank order (chief, workers, ps tasks)."""

    workers: tuple[str, ...]
    ps: tuple[str, ...]
    chief: str = "chief"

    @classmethod
    def of(cls, num_workers: int, num_ps: int) -> RpcCluster:
        return cls(
            tuple(f"worker{i}" for i in range(num_workers)), tuple(f"ps{i}" for i in range(num_ps))
        )

    @property
    def names(self) -> tuple[str, ...]:
        return (self.chief, *self.workers, *self.ps)

    def rank(self, name: str) -> int:
        return self.names.index(name)


def start_rpc(
    name: str, cluster: RpcCluster, host: str, port: int, timeout_seconds: float
) -> dist.TCPStore | None:
    """Join the RPC group as ``name``; the chief hosts the rendezvous store on ``host:port`` and
    returns it (the others None). Every other task waits for it up to ``timeout_seconds``."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    hosted = None
    if name == cluster.chief:
        hosted, (host, port) = host_store(host, port, None, timeout)
    key = secrets.token_hex(8)
    url = f"{_SCHEME}://{host}:{port}?store={key}"
    global _handler_registered
    if not _handler_registered:
        dist.register_rendezvous_handler(_SCHEME, _rendezvous)
        _handler_registered = True
    _stores[key] = dist.TCPStore(host, port, None, False, timeout=timeout)
    backend = rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=timeout_seconds)
    try:
        loopback = sockets_on_loopback(host, ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"))
        with loopback, warnings.catch_warnings():
            # init_rpc's own use of a deprecated gloo call warns in every process.
            warnings.filterwarnings("ignore", "You are using a Backend", UserWarning)
            rpc.init_rpc(
                name,
                rank=cluster.rank(name),
                world_size=len(cluster.names),
                rpc_backend_options=backend,
            )
    finally:
        del _stores[key]
    return hosted


def stop_rpc() -> None:
    """Leave the RPC group without waiting on peers (a dead one would hold us forever)."""
    rpc.shutdown(graceful=False)


def _rendezvous(url: str, timeout: Any = None, **kwargs: Any) -> Any:
    query = parse_qs(urlparse(url).query)
    yield _stores[query["store"][0]], int(query["rank"][0]), int(query["world_size"][0])
