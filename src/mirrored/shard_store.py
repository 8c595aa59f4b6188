"""What a ps task holds: the shards of each mirrored model, their optimizer, and the record of
which updates it has applied.

Every update a worker pushes carries the id of the scheduled function that computed it and its
position in that function (a function may step several times). A ps task applies each such
update once: when a worker dies after pushing to one ps task but before another, the coordinator
runs the function again elsewhere, and only the tasks that missed the update apply the new one.
Workers the coordinator gave up on are fenced: a late push from one is refused, so a worker that
was only slow cannot apply its update after the function's retry did. The record of applied
updates is trimmed below the coordinator's watermark (functions below it are finished for good).

The RPC entry points are module functions (RPC pickles functions by name); each acts on the
stores of this process, one per mirrored model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["ShardStore"]


class ShardStore:
    """The shards of one mirrored model on one ps task, and the optimizer that updates them.

    ``groups`` are the model optimizer's parameter groups, each as the keys of its shards here
    plus its hyperparameters; shards in no group (buffers) are only assigned.
    """

    def __init__(
        self,
        shards: Mapping[str, torch.Tensor],
        optimizer_class: Callable[..., torch.optim.Optimizer] | None,
        groups: Sequence[Mapping[str, Any]],
        fenced: set[str] | None = None,
    ) -> None:
        trained = {key for group in groups for key in group["keys"]}
        self._shards = {
            key: value.detach().clone().requires_grad_(key in trained)
            for key, value in shards.items()
        }
        param_groups = [
            {**{k: v for k, v in group.items() if k != "keys"}, "params": keys}
            for group in groups
            if (keys := [self._shards[key] for key in group["keys"]])
        ]
        self._optimizer = (
            optimizer_class(param_groups) if optimizer_class is not None and param_groups else None
        )
        self._lock = threading.Lock()
        self.version = 0  # updates applied
        self._applied: dict[int, set[int]] = {}  # function id -> positions of its updates
        self._fenced = set() if fenced is None else fenced  # shared by the stores of a task

    def pull(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The current value of every shard (copies: the next update must not change them on
        their way out), and how many updates they include."""
        with self._lock:
            return self.version, {k: v.detach().clone() for k, v in self._shards.items()}

    def push(
        self,
        worker: str,
        function_id: int,
        position: int,
        finished_below: int,
        gradients: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
    ) -> bool:
        """Apply one update (gradients through the optimizer, buffers assigned) unless it was
        applied before or its worker is fenced; whether it was applied."""
        with self._lock:
            for done in [f for f in self._applied if f < finished_below]:
                del self._applied[done]
            applied = self._applied.setdefault(function_id, set())
            if worker in self._fenced or position in applied:
                return False
            if gradients and self._optimizer is None:
                raise ValueError("gradients were pushed for a model mirrored without optimizer")
            with torch.no_grad():
                for key, value in buffers.items():
                    self._shards[key].copy_(value)
            if gradients and self._optimizer is not None:
                for key, gradient in gradients.items():
                    self._shards[key].grad = gradient.to(self._shards[key].dtype)
                self._optimizer.step()
                for key in gradients:
                    self._shards[key].grad = None
            applied.add(position)
            self.version += 1
            return True

    def fence(self, worker: str) -> None:
        """Refuse every later push of ``worker`` (the coordinator gave up on it); a push of it
        under way finishes first."""
        with self._lock:
            self._fenced.add(worker)


_stores: dict[int, ShardStore] = {}  # this ps task's, by model id
_fenced: set[str] = set()  # workers the coordinator gave up on


def create(
    model_id: int,
    shards: dict[str, torch.Tensor],
    optimizer_class: Callable[..., torch.optim.Optimizer] | None,
    groups: list[dict[str, Any]],
) -> None:
    _stores[model_id] = ShardStore(shards, optimizer_class, groups, _fenced)


def pull(model_id: int) -> tuple[int, dict[str, torch.Tensor]]:
    return _stores[model_id].pull()


def push(
    model_id: int,
    worker: str,
    function_id: int,
    position: int,
    finished_below: int,
    gradients: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
) -> bool:
    return _stores[model_id].push(worker, function_id, position, finished_below, gradients, buffers)


def fence(worker: str) -> None:
    _fenced.add(worker)
    for store in _stores.values():
        store.fence(worker)
