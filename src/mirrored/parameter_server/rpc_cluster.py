"""The processes of a parameter-server job as one ``torch.distributed.rpc`` group.

``torch.distributed.rpc`` leaves five things to the user that this module settles once:

- **Where it listens.** Its rendezvous store would bind every interface and TensorPipe the address
  the host name resolves to; here the store listens only on the chief's address, and TensorPipe
  and gloo use the loopback interface when that address is a loopback one.
- **Its own store connection.** ``init_rpc`` resets its store's timeout, so RPC gets a client of
  its own rather than sharing one.
- **Ending.** A graceful ``rpc.shutdown()`` waits forever for a dead peer; this group always
  shuts down without that handshake, after its own end-of-job messages.
- **Membership.** A static group (``init_rpc`` with a world size) waits forever for a missing
  member and can never take a restarted one back. Every task here joins a dynamic group instead:
  the chief waits for the others with a deadline and names the missing ones, and a restarted
  worker joins again as a new member (``worker1_2``, its second incarnation, under a rank of its
  own), once the chief has admitted it and removed the lost incarnation from the group's record
  (``Admissions``).
- **Its transport.** Between tasks of one host TensorPipe defaults to shared memory, whose
  reactor busy-polls a core in every process, so a job of more tasks than cores slows to a crawl
  and times out under load. Every pair talks TCP here (TensorPipe's ``_transports`` option).

Security: like every ``torch.distributed`` primitive, RPC is unauthenticated and unpickles what
its peers send (a peer can run any code here). Keep every task of the job on a private network:
the defaults listen on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
import torch.distributed.rpc as rpc

from mirrored._torch_distributed import rpc_agent_store, rpc_group_membership_lock
from mirrored.cluster.store import host_store, sockets_on_loopback

__all__ = [
    "Admissions",
    "Member",
    "RpcCluster",
    "forget_member",
    "start_rpc",
    "stop_rpc",
    "wait_for_members",
]

_SCHEME = "mirrored-rpc"
_PREFIX = "mirrored/rpc_cluster"  # this module's keys in the chief's store
_CLOSED = f"{_PREFIX}/closed"  # set once the chief takes no more restarted workers
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


@dataclass(frozen=True)
class Member:
    """One process in the RPC group: the ``task`` of the cluster it runs, under the ``name``
    and ``rank`` of this incarnation of it."""

    task: str
    name: str
    rank: int


def start_rpc(
    task: str,
    cluster: RpcCluster,
    host: str,
    port: int,
    timeout_seconds: float,
    launcher_store: bool = False,
) -> tuple[Member, dist.TCPStore | None]:
    """Join the RPC group as ``task``; the chief hosts the rendezvous store on ``host:port``
    (unless ``launcher_store``: a launcher hosts it there) and returns it (the others None), and
    waits up to ``timeout_seconds`` for every other task to join. A task joins under its own
    name, or, when it is a worker restarted after the job began, as a new incarnation the chief
    admits. Every other task waits for the store up to ``timeout_seconds``."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if task == cluster.chief:
        if launcher_store:
            hosted = dist.TCPStore(host, port, None, False, timeout=timeout)
        else:
            hosted, (host, port) = host_store(host, port, None, timeout)
        member = Member(task, task, cluster.rank(task))
        deadline = time.monotonic() + timeout_seconds
        _init_rpc(member, host, port, timeout_seconds)
        missing = wait_for_members(cluster.names, deadline - time.monotonic())
        if not missing:
            # A member the chief knows may still be greeting the others inside init_rpc: a
            # chief that failed then would end it with a broken pipe, not the chief's error.
            missing = _wait_until_joined(hosted, cluster.names[1:], deadline)
        if missing:
            stop_rpc()
            raise TimeoutError(
                f"task(s) {', '.join(missing)} did not join the cluster within "
                f"{timeout_seconds:g} s: start every task of the TF_CONFIG cluster (the same "
                "script, each with its own task), and check that they reach the chief's address"
            )
        return member, hosted
    client = dist.TCPStore(host, port, None, False, timeout=timeout)
    member = _incarnation(client, task, cluster, timeout_seconds)
    _init_rpc(member, host, port, timeout_seconds)
    client.set(f"{_PREFIX}/joined/{task}", member.name)
    return member, None


def _init_rpc(member: Member, host: str, port: int, timeout_seconds: float) -> None:
    """``init_rpc`` into the dynamic group through the chief's store at ``host:port``."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    key = secrets.token_hex(8)
    url = f"{_SCHEME}://{host}:{port}?store={key}"
    global _handler_registered
    if not _handler_registered:
        dist.register_rendezvous_handler(_SCHEME, _rendezvous)
        _handler_registered = True
    _stores[key] = dist.TCPStore(host, port, None, False, timeout=timeout)
    # TCP only (the module's docstring says why); TensorPipe marks the option private.
    backend = rpc.TensorPipeRpcBackendOptions(
        init_method=url, rpc_timeout=timeout_seconds, _transports=["uv"]
    )
    try:
        loopback = sockets_on_loopback(host, ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"))
        with loopback, warnings.catch_warnings():
            # init_rpc's own use of a deprecated gloo call warns in every process.
            warnings.filterwarnings("ignore", "You are using a Backend", UserWarning)
            rpc.init_rpc(member.name, rank=member.rank, rpc_backend_options=backend)
    finally:
        del _stores[key]


def wait_for_members(
    names: tuple[str, ...], timeout_seconds: float, stopping: threading.Event | None = None
) -> list[str]:
    """Those of ``names`` still not in the RPC group after waiting up to ``timeout_seconds``
    (or until ``stopping`` is set)."""
    deadline = time.monotonic() + timeout_seconds
    stopping = stopping or threading.Event()
    while True:
        missing = [name for name in names if not _is_member(name)]
        if not missing or time.monotonic() > deadline or stopping.wait(0.05):
            return missing


def _wait_until_joined(store: dist.Store, tasks: tuple[str, ...], deadline: float) -> list[str]:
    """Those of ``tasks`` whose ``init_rpc`` has still not returned at ``deadline``."""
    while True:
        missing = [task for task in tasks if not store.check([f"{_PREFIX}/joined/{task}"])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.05)


def _is_member(name: str) -> bool:
    try:
        rpc.get_worker_info(name)
    except RuntimeError:
        return False
    return True


def _incarnation(
    client: dist.TCPStore, task: str, cluster: RpcCluster, timeout_seconds: float
) -> Member:
    """Who this process joins as: ``task`` itself the first time, and after a restart of one
    lost before it joined (the chief waits for ``task``); else, a worker's next incarnation once
    the chief admits it (a ps task's state died with it: no way back)."""
    incarnation = client.add(f"{_PREFIX}/incarnations/{task}", 1)
    if incarnation == 1 or not client.check([f"{_PREFIX}/joined/{task}"]):
        return Member(task, task, cluster.rank(task))
    if task not in cluster.workers:
        raise SystemExit(
            f"{task} was restarted, but a ps task's parameters were lost with its process: "
            "restart the whole job (every task); it resumes from the coordinator's last "
            "checkpoint (ClusterCoordinator.restore, Model.load)"
        )
    rank = len(cluster.names) - 1 + client.add(f"{_PREFIX}/extra_ranks", 1)
    member = Member(task, f"{task}_{incarnation}", rank)
    request = client.add(f"{_PREFIX}/requests", 1)
    client.set(f"{_PREFIX}/request/{request}", f"{task} {member.name} {rank}")
    answer_key = f"{_PREFIX}/admitted/{member.name}"
    deadline = time.monotonic() + timeout_seconds
    try:
        while not client.check([answer_key]):
            if client.check([_CLOSED]):
                raise SystemExit(f"{task} was restarted but cannot rejoin: the job has ended")
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{task} was restarted and asked to rejoin, but the coordinator did not "
                    f"admit it within {timeout_seconds:g} s (is the job still training?)"
                )
            time.sleep(0.1)
        refusal = client.get(answer_key).decode()
    except dist.DistError as error:
        raise SystemExit(f"{task} cannot rejoin: the coordinator is gone ({error})") from error
    if refusal:
        raise SystemExit(f"{task} was restarted but cannot rejoin: {refusal}")
    return member


class Admissions:
    """The chief's side of rejoining: a thread that serves each restarted worker's request in
    turn. ``prepare(member)`` returns None when the member may join the RPC group (the chief has
    given up its lost incarnation) or why it may not; once it has joined, ``welcome(member)``
    brings it into the job. One request at a time, so that the group's record is never edited
    while a member joins."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout_seconds: float,
        prepare: Callable[[Member], str | None],
        welcome: Callable[[Member], None],
    ) -> None:
        self._client = dist.TCPStore(
            host, port, None, False, timeout=datetime.timedelta(seconds=timeout_seconds)
        )
        self._timeout_seconds = timeout_seconds
        self._prepare = prepare
        self._welcome = welcome
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="admissions")
        self._thread.start()

    def _run(self) -> None:
        served = 0
        unwritten_since: float | None = None  # the next request was counted, not yet written
        while not self._stopping.wait(0.2):
            try:
                requests = self._client.add(f"{_PREFIX}/requests", 0)
                while served < requests and not self._stopping.is_set():
                    key = f"{_PREFIX}/request/{served + 1}"
                    if not self._client.check([key]):
                        # Its writer died between counting and writing it: skip it in time.
                        unwritten_since = unwritten_since or time.monotonic()
                        if time.monotonic() - unwritten_since < self._timeout_seconds:
                            break
                        served += 1
                        continue
                    served, unwritten_since = served + 1, None
                    task, name, rank = self._client.get(key).decode().split()
                    self._serve(Member(task, name, int(rank)))
            except dist.DistError:  # the store is gone: the job is ending
                return

    def _serve(self, member: Member) -> None:
        try:
            refusal = self._prepare(member)
        except Exception as error:  # e.g. a ps task lost while fencing the old incarnation
            refusal = f"the coordinator could not give up its lost incarnation ({error})"
        self._client.set(f"{_PREFIX}/admitted/{member.name}", refusal or "")
        if refusal is None and not wait_for_members(
            (member.name,), self._timeout_seconds, self._stopping
        ):
            self._welcome(member)

    def stop(self) -> None:
        """Take no more requests (one being served finishes first); a worker that asks, or
        still waits for an answer, is told the job has ended."""
        self._stopping.set()
        self._thread.join()
        with contextlib.suppress(dist.DistError):  # the store is gone: so are its workers
            self._client.set(_CLOSED, "")


def forget_member(member: Member) -> None:
    """Remove a lost member from the dynamic group's record in the store, so that the next
    member to join does not try to greet it (and fail). ``torch.distributed.rpc`` has no public
    call for this: the record is its list ``names/_ALL_WORKER_INFOS`` of ``name-rank,`` entries
    and a ``names/<rank>`` key, edited under its group-management token (torch 2.13)."""
    store = rpc_agent_store()
    names = dist.PrefixStore("names", store)
    with rpc_group_membership_lock(store, f"forget_{member.name}"):
        entries = names.get("_ALL_WORKER_INFOS").decode().split(",")
        kept = [entry for entry in entries if entry and entry != f"{member.name}-{member.rank}"]
        names.set("_ALL_WORKER_INFOS", "".join(f"{entry}," for entry in kept))
        names.delete_key(str(member.rank))


def stop_rpc() -> None:
    """Leave the RPC group without waiting on peers (a dead one would hold us forever)."""
    rpc.shutdown(graceful=False)


def _rendezvous(url: str, timeout: Any = None, **kwargs: Any) -> Any:
    query = parse_qs(urlparse(url).query)
    yield _stores[query["store"][0]], int(query["rank"][0]), int(query["world_size"][0])
