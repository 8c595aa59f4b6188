"""The life of a worker or ps task of a ``ParameterServerStrategy``: serve the coordinator's
calls until it says stop, and end with it.

Every task runs the same script; in a worker or ps task the strategy's constructor calls
``serve`` and never returns: the process ends when the coordinator closes the strategy (the
coordinator's last message, ``stop``), with an error when the coordinator's program failed or the
coordinator itself is gone (its rendezvous store no longer answers).
"""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist
import torch.distributed.rpc as rpc

from mirrored.parameter_server.rpc_cluster import stop_rpc

__all__ = ["answers", "serve", "stop"]

_stop_serving = threading.Event()  # set by the coordinator's last message to this task
_chief_failure: str | None = None  # why the coordinator's program failed, in that message


def stop(failure: str | None) -> None:
    """The coordinator's last message to a task (run there by RPC): stop serving; ``failure``
    says why the coordinator's program failed, if it did."""
    global _chief_failure
    _chief_failure = failure
    _stop_serving.set()


def answers(task: str, timeout_seconds: float) -> bool:
    """Whether ``task`` still answers an RPC, within ``timeout_seconds``."""
    try:
        rpc.rpc_sync(task, _answer, timeout=timeout_seconds)
    except Exception:
        return False
    return True


def _answer() -> None:
    """Run by RPC: ``answers``."""


def serve(name: str, host: str, port: int) -> None:
    """A worker or ps task: answer the coordinator until it says stop, or exit with an error
    once its rendezvous store (hosted by the chief) is gone or its program failed."""
    client = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=10))
    try:
        while not _stop_serving.wait(1.0):
            try:
                client.check(["mirrored/ps/alive"])
            except Exception as error:
                raise SystemExit(
                    f"{name}: the coordinator (the chief task, {host}:{port}) is gone ({error}); "
                    "restart the job (it resumes from the coordinator's last checkpoint)"
                ) from error
    finally:
        stop_rpc()
    if _chief_failure is not None:
        raise SystemExit(
            f"{name}: the coordinator's program (the chief task) failed with {_chief_failure}; "
            "its worker and ps tasks end with it"
        )
