"""``Model.fit`` on a ``ParameterServerStrategy``: TensorFlow's fit with a ``ClusterCoordinator``.

Every training step is a function the coordinator schedules. A worker runs the compiled train
step (``Steps.train``) on the next batch of its own dataset, on its copy of the model as pulled
from the ps tasks, pushes the gradients, and returns the step's loss and metric sums. Each
worker's dataset is built on the worker from ``x``: a ``dataset_fn(InputContext)`` returning
batches (TensorFlow's ``DatasetCreator``), or its share of arrays (every n-th example). The
datasets repeat, so an epoch is ``steps_per_epoch`` steps, which fit requires (as TensorFlow does).

Steps are scheduled ahead of the workers. Batch callbacks get each step's logs as its result
comes back, in step order, and the epoch ends with ``join``. The learning rate of a step is
fixed when it is scheduled and travels with its gradients:
- a schedule is evaluated at the step's iteration;
- an ``lr_scheduler`` steps once per scheduled step;
- a callback may set ``model.learning_rate``.

Validation, ``evaluate`` and ``predict`` run on the coordinator, on the ps tasks' current
parameters (``Model`` pulls them first, and at the end of fit).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from mirrored.callbacks.backup_and_restore import BackupAndRestore
from mirrored.callbacks.history import History
from mirrored.cluster_coordinator import RemoteValue
from mirrored.input import InputContext
from mirrored.training.data_adapter import DataAdapter, _is_array_structure, unpack_batch
from mirrored.training.loss_scale import LossScale
from mirrored.training.steps import Steps
from mirrored.values import flatten, map_structure

__all__ = ["fit", "train_step"]


def fit(
    model: Any,
    x: Any,
    y: Any,
    batch_size: int | None,
    epochs: int,
    verbose: int,
    callbacks: Any,
    validation: Any,
    validate_at: Callable[[int], bool],
    shuffle: bool,
    initial_epoch: int,
    steps_per_epoch: int | None,
    sample_weight: Any,
) -> History:
    """Model.fit's loop for a ParameterServerStrategy (``model`` is the ``mirrored.Model``;
    its arguments are checked there)."""
    steps = model._compiled()
    if steps_per_epoch is None:
        raise ValueError(
            "fit() on a ParameterServerStrategy needs steps_per_epoch: every worker repeats its "
            "own dataset, so an epoch is a number of steps (as in TensorFlow)"
        )
    if any(isinstance(c, BackupAndRestore) for c in callbacks or []):
        raise ValueError(
            "BackupAndRestore does not run on a ParameterServerStrategy; save with "
            "ModelCheckpoint (Model.save writes the ps tasks' state through the coordinator) "
            "and resume with Model.load"
        )
    check_input(x, y, sample_weight, batch_size)
    coordinator = model._parameter_server_coordinator()
    dataset = coordinator.create_per_worker_dataset(
        functools.partial(worker_batches, x, y, sample_weight, batch_size, shuffle)
    )
    iterator = iter(dataset)
    on_worker = dataclasses.replace(steps, schedule=None, lr_scheduler=None)
    with model._fitting(callbacks, verbose, epochs, steps_per_epoch) as callback_list:
        callback_list.on_train_begin()
        epoch_logs: dict[str, Any] = {}
        for epoch in range(initial_epoch, epochs):
            steps.metrics.reset()
            model._set_training(True)
            callback_list.on_epoch_begin(epoch)
            results: collections.deque[tuple[int, RemoteValue]] = collections.deque()
            for step in range(steps_per_epoch):
                callback_list.on_train_batch_begin(step)
                hyperparameters = _hyperparameters_of_next_step(model, steps)
                value = coordinator.schedule(train_step, (on_worker, iterator, hyperparameters))
                results.append((step, value))
                _report(model, steps, results, callback_list, wait=False)
                if model.stop_training:
                    break
            coordinator.join()
            _report(model, steps, results, callback_list, wait=True)
            epoch_logs = model._logs()
            model._end_epoch(epoch, epoch_logs, validation, validate_at, callback_list)
            if model.stop_training:
                break
        model._pull()  # the module here ends with the trained parameters
        callback_list.on_train_end(epoch_logs)
    return model.history


def _hyperparameters_of_next_step(model: Any, steps: Steps) -> list[dict[str, Any]]:
    """The hyperparameters the next scheduled step applies its update with; then the
    ``lr_scheduler`` (if any) moves on by one step."""
    groups = model._optimizer.param_groups  # the ParameterServerOptimizer's
    if steps.schedule is not None:
        learning_rate = steps.schedule.learning_rate_at(model._iterations)
        for group in groups:
            group["lr"] = learning_rate
    hyperparameters = [dict(group) for group in groups]
    if steps.lr_scheduler is not None:
        steps.lr_scheduler.step()
        for group, stepped in zip(groups, steps.lr_scheduler.optimizer.param_groups, strict=True):
            group["lr"] = stepped["lr"]
    model._iterations += 1
    return hyperparameters


def _report(
    model: Any,
    steps: Steps,
    results: collections.deque[tuple[int, RemoteValue]],
    callback_list: Any,
    wait: bool,
) -> None:
    """Merge the results of the steps that have run, in step order, each followed by its
    ``on_train_batch_end``; without ``wait``, stop at the first still running."""
    while results and (wait or results[0][1].done()):
        step, value = results.popleft()
        state = value.fetch()
        steps.metrics.merge(state)
        callback_list.on_train_batch_end(step, model._logs(int(state[1])))


def train_step(
    steps: Steps, iterator: Iterator[Any], hyperparameters: list[dict[str, Any]]
) -> torch.Tensor:
    """On a worker: one compiled train step on the next batch of this worker's dataset, with
    the coordinator's hyperparameters of this step; the loss and metric sums."""
    steps.optimizer.param_groups = hyperparameters
    batch = next(iterator)
    size = next(
        (leaf.shape[0] for leaf in flatten(batch[0]) if isinstance(leaf, torch.Tensor)), None
    )
    if size is None:
        raise ValueError("a training batch's x holds no tensor; fit() needs tensors in x")
    state, _ = steps.train([batch], [size], 0, LossScale())
    return state


class _Batches:
    """A worker's dataset as batches ``(x, y, sample_weight)``, pass after pass: the epochs of
    its arrays, or what the dataset function returned."""

    def __init__(self, source: DataAdapter | Iterable[Any]) -> None:
        self._source = source

    def __iter__(self) -> Iterator[tuple[Any, Any, Any]]:
        if isinstance(self._source, DataAdapter):
            return self._source.epoch()
        return (unpack_batch(batch, "fit") for batch in self._source)


def check_input(x: Any, y: Any, sample_weight: Any, batch_size: int | None) -> None:
    """Refuse, on the coordinator, input that ``worker_batches`` could not use."""
    if _is_array_structure(x):
        DataAdapter(x, y, sample_weight, batch_size, False, None, "fit")  # raises what's wrong
        return
    if not callable(x):
        raise TypeError(
            f"x is a {type(x).__name__}: on a ParameterServerStrategy fit() takes arrays or a "
            "dataset function dataset_fn(input_context) -> batches, built on every worker"
        )
    for name, value in (("y", y), ("sample_weight", sample_weight), ("batch_size", batch_size)):
        if value is not None:
            raise ValueError(
                f"{name}= with a dataset function: its batches carry it (or are batched "
                f"already); drop {name}="
            )


def worker_batches(
    x: Any,
    y: Any,
    sample_weight: Any,
    batch_size: int | None,
    shuffle: bool,
    context: InputContext,
) -> Iterable[tuple[Any, Any, Any]]:
    """This worker's dataset: ``x(context)`` when x is a dataset function, else every
    ``num_input_pipelines``-th example of the arrays from its ``input_pipeline_id`` on."""
    if not _is_array_structure(x):
        return _Batches(x(context))
    take = slice(context.input_pipeline_id, None, context.num_input_pipelines)
    x, y, sample_weight = map_structure(
        lambda a: a[take] if a is not None else None, (x, y, sample_weight)
    )
    return _Batches(DataAdapter(x, y, sample_weight, batch_size, shuffle, None, "fit"))
