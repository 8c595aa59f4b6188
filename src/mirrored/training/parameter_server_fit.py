"""``Model``'s training loop on a ``ParameterServerStrategy``: TensorFlow's fit with a
``ClusterCoordinator``.

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

Validation, ``evaluate`` and ``predict`` run on the coordinator's copy of the model, on the ps
tasks' current parameters (pulled first, and at the end of fit); ``Model.save`` and ``load`` go
through the coordinator's checkpoints.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from mirrored.callbacks.backup_and_restore import BackupAndRestore
from mirrored.coordinator.cluster_coordinator import ClusterCoordinator, RemoteValue
from mirrored.core.values import flatten, map_structure
from mirrored.input import InputContext
from mirrored.strategies.default import default_strategy
from mirrored.strategies.parameter_server import ParameterServerStrategy
from mirrored.training.data_adapter import DataAdapter, _is_array_structure, unpack_batch
from mirrored.training.float16_loss_scale import LossScale
from mirrored.training.lazy_build import has_lazy_parameters
from mirrored.training.loop import FitRequest, FitRun
from mirrored.training.saved_state import ModelParts
from mirrored.training.steps import Steps

__all__ = ["ParameterServerEpochs", "ParameterServerLoop", "check_fit", "train_step"]


class ParameterServerLoop:
    """The ``TrainingLoop`` of a ``ParameterServerStrategy``: fit's steps on the workers,
    everything else on the coordinator's copy of the model (the default strategy)."""

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        self.strategy = strategy
        self.local_strategy = default_strategy()
        self._coordinator: ClusterCoordinator | None = None

    @property
    def coordinator(self) -> ClusterCoordinator:
        """The strategy's coordinator, created on first use."""
        if self._coordinator is None:
            self._coordinator = ClusterCoordinator(self.strategy)
        return self._coordinator

    def check_compile(self, module: nn.Module) -> None:
        if has_lazy_parameters(module):
            raise ValueError(
                "the module has lazy parameters, which a ParameterServerStrategy cannot build on "
                "its workers; call the module once on an example batch before compile()"
            )

    def own_module(self, replicas: Any, module: nn.Module) -> nn.Module:
        return replicas.module

    def pull(self, replicas: Any) -> None:
        if replicas is not None:
            replicas.pull()

    # -- fit ---------------------------------------------------------------------------------------
    def fit_epochs(self, request: FitRequest) -> ParameterServerEpochs:
        steps_per_epoch = check_fit(request)
        dataset = self.coordinator.create_per_worker_dataset(
            functools.partial(
                worker_batches,
                request.x,
                request.y,
                request.sample_weight,
                request.batch_size,
                request.shuffle,
            )
        )
        return ParameterServerEpochs(self, iter(dataset), steps_per_epoch, request.initial_epoch)

    # -- saving ------------------------------------------------------------------------------------
    def save(self, parts: ModelParts, filepath: str | os.PathLike[str]) -> None:
        """The coordinator's checkpoint of this model alone on the ps tasks."""
        scheduler = parts.steps.lr_scheduler
        metadata = {
            "iterations": parts.progress.iterations,
            "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
        }
        self.coordinator.save(filepath, metadata, [parts.replicas])

    def load(self, parts: ModelParts, filepath: str | os.PathLike[str]) -> None:
        metadata = self.coordinator.restore(filepath, [parts.replicas])
        parts.progress.iterations = int(metadata.get("iterations", 0))
        scheduler = parts.steps.lr_scheduler
        if scheduler is not None and metadata.get("lr_scheduler") is not None:
            scheduler.load_state_dict(metadata["lr_scheduler"])
        self.pull(parts.replicas)

    def load_weights(self, replicas: Any, module: nn.Module, weights: Any, source: str) -> None:
        self.coordinator.load_weights(replicas, weights)
        self.pull(replicas)


class ParameterServerEpochs:
    """A fit's epochs on the workers: each step a function the coordinator schedules, on the
    next batch of the worker's own dataset; the model here pulls the trained parameters at
    the end."""

    def __init__(
        self, loop: ParameterServerLoop, iterator: Any, steps_per_epoch: int, initial_epoch: int
    ) -> None:
        self._loop = loop
        self._iterator = iterator
        self.steps_per_epoch = steps_per_epoch
        self._initial_epoch = initial_epoch
        self._on_worker: Steps | None = None

    def first_epoch(self, run: FitRun) -> int:
        # The workers step without schedules: the coordinator fixes each step's learning rate.
        self._on_worker = dataclasses.replace(run.steps, schedule=None, lr_scheduler=None)
        return self._initial_epoch

    def train_epoch(self, run: FitRun, epoch: int) -> dict[str, Any]:
        """Schedule an epoch's steps, reporting each as it comes back; then wait for all."""
        coordinator = self._loop.coordinator
        results: collections.deque[tuple[int, RemoteValue]] = collections.deque()
        for step in range(self.steps_per_epoch):
            run.callbacks.on_train_batch_begin(step)
            hyperparameters = _hyperparameters_of_next_step(run)
            value = coordinator.schedule(
                train_step, (self._on_worker, self._iterator, hyperparameters)
            )
            results.append((step, value))
            _report(run, results, wait=False)
            if run.stop_training:
                break
        coordinator.join()
        _report(run, results, wait=True)
        return run.logs()

    def finish(self, run: FitRun) -> None:
        self._loop.pull(run.steps.module)  # the module here ends with the trained parameters


def check_fit(request: FitRequest) -> int:
    """Refuse, on the coordinator, what fit cannot do here; the steps of an epoch."""
    if request.steps_per_epoch is None:
        raise ValueError(
            "fit() on a ParameterServerStrategy needs steps_per_epoch: every worker repeats its "
            "own dataset, so an epoch is a number of steps (as in TensorFlow)"
        )
    if request.batch_dim != 0:
        raise ValueError(
            f"compile(input_options=InputOptions(batch_dim={request.batch_dim})): fit() on a "
            "ParameterServerStrategy reads batch-first data only; give it batches with the "
            "examples in dim 0 (transpose in the model's forward), or use MirroredStrategy"
        )
    if any(isinstance(c, BackupAndRestore) for c in request.callbacks or []):
        raise ValueError(
            "BackupAndRestore does not run on a ParameterServerStrategy; save with "
            "ModelCheckpoint (Model.save writes the ps tasks' state through the coordinator) "
            "and resume with Model.load"
        )
    check_input(request.x, request.y, request.sample_weight, request.batch_size)
    return request.steps_per_epoch


def _hyperparameters_of_next_step(run: FitRun) -> list[dict[str, Any]]:
    """The hyperparameters the next scheduled step applies its update with; then the
    ``lr_scheduler`` (if any) moves on by one step."""
    steps = run.steps
    groups = steps.optimizer.param_groups  # the ParameterServerOptimizer's
    if steps.schedule is not None:
        learning_rate = steps.schedule.learning_rate_at(run.progress.iterations)
        for group in groups:
            group["lr"] = learning_rate
    hyperparameters = [dict(group) for group in groups]
    if steps.lr_scheduler is not None:
        steps.lr_scheduler.step()
        for group, stepped in zip(groups, steps.lr_scheduler.optimizer.param_groups, strict=True):
            group["lr"] = stepped["lr"]
    run.progress.iterations += 1
    return hyperparameters


def _report(run: FitRun, results: collections.deque[tuple[int, RemoteValue]], wait: bool) -> None:
    """Merge the results of the steps that have run, in step order, each followed by its
    ``on_train_batch_end``; without ``wait``, stop at the first still running."""
    while results and (wait or results[0][1].done()):
        step, value = results.popleft()
        state = value.fetch()
        run.steps.metrics.merge(state)
        run.callbacks.on_train_batch_end(step, run.logs(int(state[1])))


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
