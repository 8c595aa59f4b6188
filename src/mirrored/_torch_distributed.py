"""The one place mirrored reaches into ``torch.distributed``'s private names, each checked
against the torch it runs on, as :mod:`mirrored._torch_internals` checks the rest: the default
process group's store, the elastic agent's workers and its polling of them, the RPC group's
record of its members.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from mirrored._torch_internals import code_of, parameter_names, required

__all__ = [
    "before_each_worker_poll",
    "default_store",
    "elastic_worker_processes",
    "rpc_agent_store",
    "rpc_group_membership_lock",
]


# -- torch.distributed's process group (mirrored.comm.worker_group)
# ----------------------------------


def default_store() -> Any:
    """``torch.distributed.distributed_c10d._get_default_store()``: the rendezvous store of the
    default process group, which a program that set up ``torch.distributed`` itself made (the
    workers publish their heartbeats on it). Raises an ``ImportError`` naming it where this
    torch has none."""
    from torch.distributed import distributed_c10d

    return required(
        distributed_c10d,
        "torch.distributed.distributed_c10d",
        "_get_default_store",
        "join the rendezvous store of a process group the program set up itself",
    )()


# -- torch.distributed.elastic (mirrored.launch.launcher)
# ----------------------------------------------


@functools.cache
def _elastic_agent_recognised() -> bool:
    """Whether torch's ``LocalElasticAgent`` keeps its workers' process context in
    ``self._pcontext``: set by ``_start_workers``, polled by ``_monitor_workers``."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    methods = (
        LocalElasticAgent.__dict__.get(name) for name in ("_start_workers", "_monitor_workers")
    )
    codes = [code_of(method) for method in methods]
    return all(code is not None and "_pcontext" in code.co_names for code in codes)


def elastic_worker_processes(agent: Any) -> Any:
    """The process context (``PContext``) of an elastic ``agent``'s workers: its private
    ``_pcontext``. Fallback, on a torch whose agent is not recognised: None (the caller leaves
    the workers' exit statuses to torch)."""
    return getattr(agent, "_pcontext", None) if _elastic_agent_recognised() else None


# -- the elastic agent's monitoring, the RPC group's record (mirrored.launch.agent, rpc_cluster) --


@functools.cache
def _worker_polls_recognised() -> bool:
    """Whether torch's elastic agent polls its workers by calling
    ``self._monitor_workers(worker_group)`` from its run loop (``_invoke_run``)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent.__dict__.get("_monitor_workers")
    run_loop = code_of(SimpleElasticAgent.__dict__.get("_invoke_run"))
    return (
        parameter_names(monitor) == ["self", "worker_group"]
        and run_loop is not None
        and "_monitor_workers" in run_loop.co_names
    )


def before_each_worker_poll(agent: Any, look: Callable[[Any], None]) -> None:
    """Have the elastic ``agent`` (a ``LocalElasticAgent``) call ``look(processes)``, with its
    workers' process context (:func:`elastic_worker_processes`), each time it polls its workers'
    exit statuses: its private ``_monitor_workers`` is wrapped on the instance. Fallback, on a
    torch whose agent is not recognised: nothing is wrapped (the statuses are left to torch)."""
    if not (_elastic_agent_recognised() and _worker_polls_recognised()):
        return
    poll = agent._monitor_workers

    def look_then_poll(worker_group: Any) -> Any:
        look(elastic_worker_processes(agent))
        return poll(worker_group)

    agent._monitor_workers = look_then_poll


def rpc_agent_store() -> Any:
    """The store of this process's ``torch.distributed.rpc`` agent, where its dynamic group
    keeps the record of its members (private ``rpc.api._get_current_rpc_agent``)."""
    from torch.distributed.rpc import api

    current_agent = required(
        api, "torch.distributed.rpc.api", "_get_current_rpc_agent", "find the RPC group's store"
    )
    return current_agent().store


def rpc_group_membership_lock(store: Any, name: str) -> AbstractContextManager[None]:
    """Hold ``torch.distributed.rpc``'s lock on its dynamic group's record in ``store`` (the
    token its members take to join or leave; ``name``: who holds it), to edit that record
    (private ``_utils._group_membership_management(store, name, is_join)``). Raises an
    ``ImportError`` naming it on a torch without it, or with another signature."""
    from torch.distributed.rpc import _utils

    found = getattr(_utils, "_group_membership_management", None)
    recognised = parameter_names(found) == ["store", "name", "is_join"]
    lock = required(
        _utils if recognised else None,
        "torch.distributed.rpc._utils",
        "_group_membership_management",
        "edit the RPC group's record of its members (as a (store, name, is_join) lock)",
    )
    return lock(store, name, False)
