"""The interface between ``mirrored.Model`` and the loop that trains it on its strategy.

``Model`` is written once. What differs between the replicated strategies and a
``ParameterServerStrategy`` (where fit's steps run, where evaluate and predict run, how the
state reaches a file) is one ``TrainingLoop``, chosen when the model is created. A loop sees the
model only through what it is handed: a ``FitRequest`` (fit's checked arguments), a ``FitRun``
(the callbacks and the pieces every fit loop shares) and ``ModelParts`` (what is saved).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from torch import nn

from mirrored.callbacks.backup_and_restore import BackupAndRestore
from mirrored.callbacks.callback import Callback, CallbackList
from mirrored.callbacks.history import History
from mirrored.callbacks.progbar_logger import ProgbarLogger
from mirrored.preemption import PreemptionWatcher
from mirrored.training.data_adapter import DataAdapter
from mirrored.training.saved_state import ModelParts, TrainingProgress
from mirrored.training.steps import Steps

__all__ = [
    "FitEpochs",
    "FitRequest",
    "FitRun",
    "LocalBatches",
    "TrainingLoop",
    "callback_list_for",
]


@dataclasses.dataclass(frozen=True)
class FitRequest:
    """``Model.fit``'s arguments, checked there; the data ones are the loop's to read."""

    x: Any
    y: Any
    sample_weight: Any
    batch_size: int | None
    batch_dim: int  # compile's InputOptions(batch_dim=...): arrays are batched along it
    shuffle: bool
    epochs: int
    initial_epoch: int
    steps_per_epoch: int | None
    verbose: int
    callbacks: Sequence[Callback] | None
    validation: DataAdapter | None
    validate_at: Callable[[int], bool]  # whether to validate after an epoch (0-based)


@dataclasses.dataclass(frozen=True)
class LocalBatches:
    """How the model runs its own batches in this process: evaluate, predict, and the
    replicated strategies' fit."""

    strategy: Any  # the strategy the batches run on
    # distributed batches, steps_per_execution at a time (a lazy module built on the first)
    executions: Callable[[Iterator[Any]], Iterator[list[Any]]]
    set_training: Callable[[bool], None]  # every local copy of the module to that mode


@dataclasses.dataclass
class FitRun:
    """One ``fit()`` call as a loop drives it: the callbacks in their order, the compiled
    steps, the count of iterations, and an epoch's start and end, the same in every loop.
    ``position``, ``epoch_rng`` and ``resume`` are where ``BackupAndRestore`` reads and sets
    the fit's place (through ``Model``)."""

    model: Any  # the mirrored.Model: the callbacks' model, its stop_training and learning rate
    steps: Steps  # its module and optimizer are the mirrored ones once mirrored
    progress: TrainingProgress
    callbacks: CallbackList
    request: FitRequest
    local: LocalBatches
    evaluate: Callable[[DataAdapter, CallbackList], dict[str, Any]]
    position: dict[str, Any]  # epoch, batches done in it, batches consumed from an iterator
    epoch_rng: dict[str, Any] | None = None  # the random state of the epoch's start
    resume: dict[str, Any] | None = None  # where a restored backup says to go on
    preemption: PreemptionWatcher | None = None  # with a BackupAndRestore: SIGTERM recorded

    def preemption_requested(self) -> bool:
        """Whether any worker got SIGTERM (a collective with several: at a step boundary)."""
        return self.preemption is not None and self.preemption.requested(self.model.strategy)

    @property
    def stop_training(self) -> bool:
        return bool(self.model.stop_training)

    def logs(self, num_examples: int | None = None) -> dict[str, Any]:
        logs: dict[str, Any] = self.steps.metrics.results()
        if num_examples is not None:
            logs["num_examples"] = num_examples
        return logs

    def begin_epoch(self, epoch: int) -> None:
        self.steps.metrics.reset()
        self.local.set_training(True)
        self.callbacks.on_epoch_begin(epoch)

    def end_epoch(self, epoch: int, logs: dict[str, Any]) -> None:
        """Completes an epoch's logs (validation figures when due, the learning rate) and hands
        them to the callbacks."""
        validation = self.request.validation
        if validation is not None and self.request.validate_at(epoch):
            validation_logs = self.evaluate(validation, self.callbacks)
            logs.update({f"val_{k}": v for k, v in validation_logs.items()})
        logs["learning_rate"] = self.model.learning_rate
        self.callbacks.on_epoch_end(epoch, logs)


class FitEpochs(Protocol):
    """One fit's epochs on one kind of strategy, prepared from its request (data checked);
    :func:`mirrored.training.trainer.fit` runs them."""

    @property
    def steps_per_epoch(self) -> int | None:
        """Batches per epoch; None when the data's length is unknown."""

    def first_epoch(self, run: FitRun) -> int:
        """The epoch to start at, once ``on_train_begin`` ran (a restored backup's, else the
        request's ``initial_epoch``)."""

    def train_epoch(self, run: FitRun, epoch: int) -> dict[str, Any] | None:
        """Run one epoch's steps with their batch callbacks; its logs, or None when the input
        ran out before the epoch began (no epoch to report)."""

    def finish(self, run: FitRun) -> None:
        """After the last epoch, before ``on_train_end``."""


class TrainingLoop(Protocol):
    """What a kind of strategy does for ``Model``; one is chosen per model, from its strategy."""

    local_strategy: Any  # where evaluate and predict run

    def check_compile(self, module: nn.Module) -> None:
        """Refuse, in compile, a module this loop cannot train."""

    def own_module(self, replicas: Any, module: nn.Module) -> nn.Module:
        """The module ``Model.module`` is once mirrored (``replicas``: what ``mirror`` gave)."""

    def pull(self, replicas: Any) -> None:
        """Bring the trained parameters into the model's copy here, where they live elsewhere."""

    def fit_epochs(self, request: FitRequest) -> FitEpochs:
        """Check fit's data and prepare its epochs (nothing runs yet)."""

    def save(self, parts: ModelParts, filepath: str | os.PathLike[str]) -> None:
        """Write the whole training state where the strategy writes checkpoints."""

    def load(self, parts: ModelParts, filepath: str | os.PathLike[str]) -> None:
        """Restore a file ``save`` wrote."""

    def load_weights(self, replicas: Any, module: nn.Module, weights: Any, source: str) -> None:
        """Load a state dict into every copy of the module, all or nothing."""


def callback_list_for(
    model: Any, callbacks: Sequence[Callback] | None, verbose: int, with_history: bool
) -> CallbackList:
    """The progress bar first (as in tf.keras: an epoch's line is out before what the user's
    callbacks print at its end), History, the user's callbacks, backups after them (so an
    epoch's backup has what they recorded for it)."""
    given = list(callbacks or [])
    if not all(isinstance(c, Callback) for c in given):
        CallbackList(given)  # raises the TypeError naming the wrong one
    ordered: list[Callback] = [ProgbarLogger()] if verbose else []
    if with_history:
        model.history = History()
        ordered.append(model.history)
    ordered += [c for c in given if not isinstance(c, BackupAndRestore)]
    ordered += [c for c in given if isinstance(c, BackupAndRestore)]
    callback_list = CallbackList(ordered)
    callback_list.set_model(model)
    return callback_list
