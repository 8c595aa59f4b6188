"""The handles ``ParameterServerStrategy.mirror`` returns: a model and an optimizer that stand for
the state on the ps tasks.

They are what scheduled functions take as arguments: pickled, each becomes its worker-side
counterpart (``mirrored.parameter_server.worker``), so a function written against a module and an
optimizer runs unchanged on a worker, pulling parameters and pushing gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from mirrored.parameter_server import worker as parameter_server_worker

__all__ = ["ParameterServerModule", "ParameterServerOptimizer"]


class ParameterServerModule(nn.Module):
    """A model whose parameters live on the ps tasks. Pass it to scheduled functions (on a
    worker it is the worker's copy, pulled fresh); on the coordinator ``pull()`` brings the
    current values into the local copy, which ``forward`` and ``state_dict`` then use."""

    def __init__(self, model_id: int, local: parameter_server_worker.WorkerModel) -> None:
        super().__init__()
        self.model_id = model_id
        self.local = local

    @property
    def module(self) -> nn.Module:
        return self.local.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.local(*args, **kwargs)

    def pull(self) -> None:
        """Copy the ps tasks' current parameters and buffers into the local copy."""
        self.local.pull()

    def __reduce__(self) -> tuple[Callable[[int], Any], tuple[int]]:
        return parameter_server_worker.model, (self.model_id,)


class ParameterServerOptimizer:
    """A mirrored model's optimizer: pass it to scheduled functions, where ``step()`` pushes the
    gradients to the ps tasks that apply them. ``param_groups`` holds each group's
    hyperparameters (no tensors): change them here (``group["lr"] = ...``) and every function
    scheduled from then on applies its updates with the new values."""

    def __init__(self, model_id: int, param_groups: list[dict[str, Any]]) -> None:
        self.model_id = model_id
        self.param_groups = param_groups

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[int, list[dict[str, Any]]]]:
        return parameter_server_worker.optimizer, (
            self.model_id,
            [dict(group) for group in self.param_groups],
        )
