"""Where ``mirrored launch``'s sockets listen: the rendezvous stores, bound to one address.

The store has no authentication: whoever reaches its port can read and write the job's keys, join
the job or stall it. So:

- the stores are ``TCPStore`` servers in the launcher of node 0: the agents' store on
  (``--master-addr``, ``--master-port``) for the whole job, and for each attempt (the first start
  and every restart) a fresh one for its workers on (``--master-addr``, a free port). Plain
  torchrun's servers listen on every interface (``*:port``) whatever host they are given; here
  the launcher binds each socket itself and hands it over with ``TCPStore(master_listen_fd=...)``,
  so they listen on that address only (127.0.0.1 by default; ``--master-port 0`` picks a free
  port, race-free since the socket is already bound). The elastic agents of every node, node 0's
  included, and all workers are clients: workers get MASTER_ADDR = ``--master-addr``,
  MASTER_PORT = their attempt's store and TORCHELASTIC_USE_AGENT_STORE=True, with which
  ``init_process_group`` starts no server of its own. The agents use the rendezvous handler
  below, torch's static one made client-only, registered in torch's public
  ``rendezvous_handler_registry``.
- gloo's connections between workers: each worker listens on the address of GLOO_SOCKET_IFNAME's
  interface or, unset, on the address the machine's hostname resolves to, which is a LAN address
  on most machines even when MASTER_ADDR is 127.0.0.1. With a loopback ``--master-addr`` every
  worker is on this machine, so the launcher sets GLOO_SOCKET_IFNAME to the loopback interface
  (``lo``) for the workers unless it is set already (``mirrored.launch.launcher``).
- nothing else: the agent opens a health-check port only when TORCHELASTIC_HEALTH_CHECK_PORT is
  set. (tests/test_launch.py reads every listening socket of a running job from /proc.)
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

__all__ = [
    "BACKEND",
    "RUN_ID",
    "AddressError",
    "ClientStaticRendezvous",
    "create_rendezvous",
    "is_loopback",
    "resolve_address",
    "serve_store",
]

BACKEND = "mirrored-static"  # our rendezvous handler's name in torch's registry
RUN_ID = "mirrored"  # the same on every node: it prefixes the job's keys in the store
_RENDEZVOUS_TIMEOUT_S = 900  # torchrun's default wait for the other nodes


class AddressError(ValueError):
    """``--master-addr`` / ``--master-port`` cannot be resolved or listened on."""


def resolve_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    """The first address ``host`` resolves to, with its family."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise AddressError(
            f"--master-addr {host}: cannot resolve it ({error.strerror}); pass node 0's IP "
            "address or a name this machine resolves"
        ) from error
    return family, (str(address[0]), int(address[1]))


def serve_store(host: str, port: int) -> TCPStore:
    """A store server listening on (host, port) only; it stops when the last reference goes.

    ``TCPStore(is_master=True)`` binds its own socket to every interface whatever ``host`` is; a
    socket we bind ourselves and pass as ``master_listen_fd`` is used as it is.
    """
    family, address = resolve_address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        bound_port = int(sock.getsockname()[1])
        server = TCPStore(
            host, bound_port, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno()
        )
    except OSError as error:
        sock.close()
        raise AddressError(
            f"--master-addr {host} --master-port {port}: cannot listen there ({error.strerror}); "
            "on node 0 pass one of this machine's addresses and a free port (0: pick one)"
        ) from error
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it when it stops
    return server


class ClientStaticRendezvous(RendezvousHandler):
    """torch's static rendezvous (fixed nodes and ranks), a client of the launcher's store.

    Each round (the first start and every restart) has its own key prefix, and node 0 starts a
    fresh store for that round's workers: workers use the agent's store with no prefix of their
    own (TORCHELASTIC_USE_AGENT_STORE), so on a reused one a restarted worker can read the
    attempt before's keys and dial a dead peer (gloo's "Connection refused"), as plain
    torchrun's restarted workers do.
    """

    def __init__(self, master_addr: str, master_port: int, node_rank: int, nnodes: int) -> None:
        self._master_addr = master_addr
        self._master_port = master_port
        self._node_rank = node_rank
        self._nnodes = nnodes
        self._store: Store | None = None
        self._workers_store: TCPStore | None = None  # node 0's, for this round's workers
        self._round = 0

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to node 0's store through MASTER_ADDR and MASTER_PORT

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = TCPStore(
                self._master_addr,
                self._master_port,
                is_master=False,
                timeout=timedelta(seconds=_RENDEZVOUS_TIMEOUT_S),
            )
        store = PrefixStore(f"{RUN_ID}/{self._round}", self._store)
        self._round += 1
        if self._node_rank == 0:
            self._workers_store = None  # the last round's workers are stopped: so is their store
            self._workers_store = serve_store(self._master_addr, 0)
            store.set("workers_store_port", str(self._workers_store.port))
        workers_port = int(store.get("workers_store_port"))  # waits for node 0
        return RendezvousInfo(
            store,
            self._node_rank,
            self._nnodes,
            RendezvousStoreInfo(self._master_addr, workers_port),
        )

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return RUN_ID

    def shutdown(self) -> bool:
        self._store = self._workers_store = None
        return True


def create_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    """The factory registered as ``BACKEND`` in torch's ``rendezvous_handler_registry``."""
    return ClientStaticRendezvous(
        params.get("master_addr"),
        int(params.get("master_port")),
        int(params.get("node_rank")),
        params.max_nodes,
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` resolves to a loopback address (then every worker is on this machine)."""
    try:
        return ipaddress.ip_address(resolve_address(host, 0)[1][0]).is_loopback
    except ValueError:
        return False
