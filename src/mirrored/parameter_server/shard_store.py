"""What a ps task holds: the shards of each mirrored model, their optimizer, and the record of
which updates it has applied.

Every update a worker pushes carries the id of the scheduled function that computed it and its
position in that function (a function may step several times). A ps task applies each such
update once: when a worker dies after pushing to one ps task but before another, the coordinator
runs the function again elsewhere, and only the tasks that missed the update apply the new one.
Workers the coordinator gave up on are fenced: a late push from one is refused, so a worker that
was only slow cannot apply its update after the function's retry did. The record of applied
updates is trimmed below the coordinator's watermark (functions below it are finished for good).

In synchronous mode an update is not applied when it arrives: it waits, under its function's id,
until the coordinator commits the round of functions it belongs to; the round's updates are then
averaged (the k-th step of every function together) and applied as one step, as a synchronous
data-parallel step over the round's batches would. A retried function's push replaces the one of
its lost run, so each function counts once.

The RPC entry points are module functions (RPC pickles functions by name); each acts on the
stores of this process, one per mirrored model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["ShardStore"]

#: One pushed update: gradients, buffers, and the hyperparameters of each parameter group.
_Update = tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], Sequence[Mapping[str, Any]]]


class ShardStore:
    """The shards of one mirrored model on one ps task, and the optimizer that updates them.

    ``groups`` are the model optimizer's parameter groups, each as the keys of its shards here
    plus its hyperparameters; shards in no group (buffers) are only assigned. ``synchronous``:
    updates wait for ``commit`` (see the module's docstring).
    """

    def __init__(
        self,
        shards: Mapping[str, torch.Tensor],
        optimizer_class: Callable[..., torch.optim.Optimizer] | None,
        groups: Sequence[Mapping[str, Any]],
        fenced: set[str] | None = None,
        synchronous: bool = False,
    ) -> None:
        trained = {key for group in groups for key in group["keys"]}
        self._shards = {
            key: value.detach().clone().requires_grad_(key in trained)
            for key, value in shards.items()
        }
        param_groups, self._group_of = [], []  # the model's group index of each group here
        for index, group in enumerate(groups):
            if keys := [self._shards[key] for key in group["keys"]]:
                param_groups.append(
                    {**{k: v for k, v in group.items() if k != "keys"}, "params": keys}
                )
                self._group_of.append(index)
        self._optimizer = (
            optimizer_class(param_groups) if optimizer_class is not None and param_groups else None
        )
        self._lock = threading.Lock()
        self.version = 0  # updates applied
        self._applied: dict[int, set[int]] = {}  # function id -> positions of its updates
        self._fenced = set() if fenced is None else fenced  # shared by the stores of a task
        self._synchronous = synchronous
        self._pending: dict[int, dict[int, _Update]] = {}  # function id -> position -> update

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
        hyperparameters: Sequence[Mapping[str, Any]] = (),
    ) -> bool:
        """Apply one update (gradients through the optimizer with the worker's
        ``hyperparameters`` for each of the model's parameter groups, buffers assigned) unless
        it was applied before or its worker is fenced; whether it was taken. In synchronous
        mode the update waits for its round's ``commit``."""
        with self._lock:
            if worker in self._fenced:
                return False
            if gradients and self._optimizer is None:
                raise ValueError("gradients were pushed for a model mirrored without optimizer")
            if self._synchronous:
                update = (gradients, buffers, hyperparameters)
                self._pending.setdefault(function_id, {})[position] = update
                return True
            for done in [f for f in self._applied if f < finished_below]:
                del self._applied[done]
            applied = self._applied.setdefault(function_id, set())
            if position in applied:
                return False
            self._apply(gradients, buffers, hyperparameters)
            applied.add(position)
            return True

    def commit(self, function_ids: Sequence[int]) -> None:
        """Apply the updates of one round of functions (synchronous mode): for each step
        position, the mean of the functions' gradients at it, with the buffers and
        hyperparameters of the first function (in id order) that stepped there."""
        with self._lock:
            updates = [self._pending.pop(f) for f in sorted(function_ids) if f in self._pending]
            for position in sorted({p for update in updates for p in update}):
                parts = [update[position] for update in updates if position in update]
                keys = {key for gradients, _, _ in parts for key in gradients}
                mean = {
                    key: torch.stack(
                        [g[key].to(self._shards[key].dtype) for g, _, _ in parts if key in g]
                    ).mean(dim=0)
                    for key in keys
                }
                self._apply(mean, parts[0][1], parts[0][2])

    def _apply(
        self,
        gradients: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        hyperparameters: Sequence[Mapping[str, Any]],
    ) -> None:
        with torch.no_grad():
            for key, value in buffers.items():
                self._shards[key].copy_(value)
        if gradients and self._optimizer is not None:
            for group, index in zip(self._optimizer.param_groups, self._group_of, strict=True):
                if index < len(hyperparameters):
                    group.update({k: v for k, v in hyperparameters[index].items() if k != "params"})
            for key, gradient in gradients.items():
                self._shards[key].grad = gradient.to(self._shards[key].dtype)
            self._optimizer.step()
            for key in gradients:
                self._shards[key].grad = None
        self.version += 1

    def state_dict(self) -> dict[str, Any]:
        """Copies of the shards and of the optimizer's state of each (``{key: {name: value}}``),
        for a checkpoint."""
        with self._lock:
            optimizer_state = self._optimizer.state if self._optimizer is not None else {}
            return {
                "shards": {k: v.detach().clone() for k, v in self._shards.items()},
                "optimizer": {
                    key: {name: _copy(value) for name, value in optimizer_state[shard].items()}
                    for key, shard in self._shards.items()
                    if shard in optimizer_state
                },
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the shards and their optimizer state with a checkpoint's (all or nothing:
        every key and shape is checked first); updates still waiting are dropped."""
        shards, optimizer_state = state["shards"], state["optimizer"]
        with self._lock:
            if shards.keys() != self._shards.keys():
                raise ValueError(
                    f"the checkpoint has shards {sorted(shards)}, this ps task holds "
                    f"{sorted(self._shards)}"
                )
            for key, value in shards.items():
                if value.shape != self._shards[key].shape:
                    raise ValueError(
                        f"shard {key!r}: the checkpoint's shape {list(value.shape)} is not "
                        f"{list(self._shards[key].shape)}"
                    )
            unknown = set(optimizer_state) - set(self._shards)
            if unknown or (optimizer_state and self._optimizer is None):
                raise ValueError(
                    f"optimizer state for shards this ps task does not train: {unknown}"
                )
            with torch.no_grad():
                for key, value in shards.items():
                    self._shards[key].copy_(value)
            if self._optimizer is not None:
                self._optimizer.state.clear()
                for key, values in optimizer_state.items():
                    self._optimizer.state[self._shards[key]] = {
                        name: _copy(value) for name, value in values.items()
                    }
            self._pending.clear()

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
    synchronous: bool,
) -> None:
    _stores[model_id] = ShardStore(shards, optimizer_class, groups, _fenced, synchronous)


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
    hyperparameters: list[dict[str, Any]],
) -> bool:
    return _stores[model_id].push(
        worker, function_id, position, finished_below, gradients, buffers, hyperparameters
    )


def fence(worker: str) -> None:
    _fenced.add(worker)
    for store in _stores.values():
        store.fence(worker)


def commit(function_ids: list[int]) -> None:
    for store in _stores.values():
        store.commit(function_ids)


def state_dict(model_id: int) -> dict[str, Any]:
    return _stores[model_id].state_dict()


def load_state_dict(model_id: int, state: dict[str, Any]) -> None:
    _stores[model_id].load_state_dict(state)


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
