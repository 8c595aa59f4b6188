"""The worker side of a parameter-server job: what a scheduled function runs with.

A function the coordinator schedules arrives here with its arguments; the coordinator's handles
among them (a mirrored model, its optimizer, a per-worker iterator) unpickle into this worker's
own objects, registered under the handle's id when the coordinator created them:

- a model (``WorkerModel``) first pulls the current parameters from the ps tasks, so the
  function computes on them;
- ``optimizer.step()`` (``WorkerOptimizer``) pushes the model's gradients, cut into the shards of
  each ps task, with the function's id and the step's position in it (each ps task applies an
  update once; ``mirrored.parameter_server.shard_store``);
- a per-worker iterator yields this worker's own batches, starting a new pass over its dataset
  whenever one ends (TensorFlow asks for ``repeat()``).

The function's own errors come back as values, so that every error of the RPC call itself means
the worker or its connection was lost. A ps task that cannot be reached during a pull or a push
comes back as such, not as the function's error: the job cannot go on without it.
"""

from __future__ import annotations

import pickle
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from mirrored.core.values import flatten, map_structure
from mirrored.parameter_server import shard_store
from mirrored.partitioners import ShardSpec

__all__ = ["ParameterServerLostError", "WorkerModel", "WorkerOptimizer", "shard_rows"]

_models: dict[int, WorkerModel] = {}
_iterators: dict[int, RepeatingIterator] = {}
_running = threading.local()  # .function: the _Running of the scheduled function under way


@dataclass
class _Running:
    """The scheduled function under way on this thread."""

    function_id: int
    finished_below: int  # the coordinator's watermark: every function below it has finished
    pushes: dict[int, int] = field(default_factory=dict)  # model id -> updates pushed so far
    pulled: set[int] = field(default_factory=set)  # ids of the models pulled for it


class ParameterServerLostError(RuntimeError):
    """A ps task did not answer a pull or a push (its process died, or it timed out)."""


def _wait_all(futures: list[tuple[str, Any]]) -> list[Any]:
    """The results of RPCs to ps tasks, ``(name, future)`` each; a failed one is a lost ps."""
    results = []
    for name, future in futures:
        try:
            results.append(future.wait())
        except Exception as error:
            raise ParameterServerLostError(f"ps task {name} did not answer: {error}") from error
    return results


class WorkerModel(nn.Module):
    """A mirrored model as a scheduled function sees it: this worker's copy, holding the ps
    tasks' parameters as of the function's start and no gradients (pulled when the function
    starts, if it is among the function's arguments, else at its first forward, e.g. inside a
    dataclass)."""

    def __init__(
        self, model_id: int, module: nn.Module, shards: list[ShardSpec], timeout_seconds: float
    ) -> None:
        super().__init__()
        self.module = module
        self._model_id = model_id
        self._shards = shards
        self._timeout_seconds = timeout_seconds
        self._names = dict(module.named_parameters()) | dict(module.named_buffers())
        self._parameters_by_name = dict(module.named_parameters())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.pull_for_function()
        return self.module(*args, **kwargs)

    def pull_for_function(self) -> None:
        """Pull, once per scheduled function (a no-op outside one), and drop the gradients an
        earlier function left here: each function starts from the ps tasks' values alone, so
        that one run again on another worker computes the same update."""
        running = getattr(_running, "function", None)
        if running is not None and self._model_id not in running.pulled:
            running.pulled.add(self._model_id)
            self.pull()
            for parameter in self._parameters_by_name.values():
                parameter.grad = None

    def pull(self) -> None:
        """Copy the ps tasks' current values into this worker's module."""
        tasks = sorted({shard.ps for shard in self._shards})
        futures = [
            (
                f"ps{ps}",
                rpc.rpc_async(
                    f"ps{ps}", shard_store.pull, (self._model_id,), timeout=self._timeout_seconds
                ),
            )
            for ps in tasks
        ]
        values: dict[str, torch.Tensor] = {}
        for _, shards in _wait_all(futures):
            values.update(shards)
        with torch.no_grad():
            for shard in self._shards:
                shard_rows(self._names[shard.name], shard).copy_(values[shard.key])

    def push(self, hyperparameters: list[dict[str, Any]]) -> None:
        """Send this worker's gradients (and buffers) to the ps tasks, as one update of the
        running function, to be applied with ``hyperparameters`` (one dict per parameter
        group of the model's optimizer)."""
        running = _running.function
        position = running.pushes.get(self._model_id, 0)
        running.pushes[self._model_id] = position + 1
        by_task: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        for shard in self._shards:
            gradients, buffers = by_task.setdefault(shard.ps, ({}, {}))
            parameter = self._parameters_by_name.get(shard.name)
            if parameter is None:
                buffers[shard.key] = shard_rows(self._names[shard.name], shard).detach()
            elif parameter.grad is not None:
                gradients[shard.key] = shard_rows(parameter.grad, shard)
        worker = rpc.get_worker_info().name
        futures = [
            (
                f"ps{ps}",
                rpc.rpc_async(
                    f"ps{ps}",
                    shard_store.push,
                    (
                        self._model_id,
                        worker,
                        running.function_id,
                        position,
                        running.finished_below,
                        *update,
                        hyperparameters,
                    ),
                    timeout=self._timeout_seconds,
                ),
            )
            for ps, update in sorted(by_task.items())
        ]
        _wait_all(futures)


class WorkerOptimizer:
    """A mirrored optimizer as a scheduled function sees it: ``step()`` pushes the model's
    gradients to the ps tasks, where the real optimizer applies them with this function's
    ``param_groups`` hyperparameters (the coordinator's when it scheduled the function; a change
    here, e.g. a learning-rate schedule, applies to this function's later steps)."""

    def __init__(self, model: WorkerModel, param_groups: list[dict[str, Any]]) -> None:
        self.model = model
        self.param_groups = param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError(
                "a parameter-server optimizer cannot re-evaluate a closure: its update happens "
                "on the ps tasks; call step() without one"
            )
        self.model.push(self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.module.zero_grad(set_to_none)


class RepeatingIterator:
    """This worker's batches: pass after pass over its dataset."""

    def __init__(self, dataset: Iterable[Any]) -> None:
        self._dataset = dataset
        self._iterator: Iterator[Any] = iter(dataset)

    def __iter__(self) -> RepeatingIterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._dataset)
        try:
            return next(self._iterator)
        except StopIteration:
            raise ValueError(
                "the per-worker dataset yields nothing on a new pass: return a re-iterable "
                "(a list, a DataLoader) or an endless generator from dataset_fn"
            ) from None


def shard_rows(tensor: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """The part of a parameter (or its gradient) that ``shard`` holds."""
    return tensor[shard.start : shard.stop] if shard.num_shards > 1 else tensor


# -- RPC entry points and unpickling hooks -------------------------------------------------------
def register_model(
    model_id: int, module: nn.Module, shards: list[ShardSpec], timeout_seconds: float
) -> None:
    _models[model_id] = WorkerModel(model_id, module, shards, timeout_seconds)


def register_dataset(
    dataset_id: int, dataset_fn: Callable[..., Iterable[Any]], context: Any
) -> None:
    _iterators[dataset_id] = RepeatingIterator(dataset_fn(context))


def model(model_id: int) -> WorkerModel:
    return _models[model_id]


def optimizer(model_id: int, param_groups: list[dict[str, Any]]) -> WorkerOptimizer:
    return WorkerOptimizer(_models[model_id], param_groups)


def iterator(dataset_id: int) -> RepeatingIterator:
    return _iterators[dataset_id]


def run_function(function_id: int, finished_below: int, call: bytes) -> tuple[str, Any]:
    """Run one scheduled function (``call``: it and its arguments, pickled): ``("ok",
    result)``; ``("raised", (type name, message, traceback))`` when it raised or could not be
    loaded here; ``("ps_lost", message)`` when a ps task did not answer."""
    try:
        fn, args, kwargs = pickle.loads(call)
    except Exception as error:
        return "raised", (
            type(error).__name__,
            f"{error} (this worker could not load the function or its arguments: define the "
            "function at module level in the script every task runs, above the line that "
            "creates the strategy, where worker tasks stop to serve)",
            traceback.format_exc(),
        )
    _running.function = _Running(function_id, finished_below)
    try:
        for used in flatten((args, kwargs)):
            if isinstance(used, WorkerModel):
                used.pull_for_function()
        result = fn(*args, **kwargs)
        return "ok", _detached(result)
    except ParameterServerLostError as error:
        return "ps_lost", str(error)
    except Exception as error:
        return "raised", (type(error).__name__, str(error), traceback.format_exc())
    finally:
        del _running.function


def _detached(value: Any) -> Any:
    return map_structure(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, value)
