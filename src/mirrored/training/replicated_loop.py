"""``Model``'s training loop on the replicated strategies: one device, ``MirroredStrategy``,
the multi-worker strategy, pipelines.

Every batch of the global batch is split across the replicas by ``strategy.run``, and every
replica applies the same update, so the model here is the model; a checkpoint is this process's
state, written by the chief. Fit keeps its place (epoch, batch, random state) for
``BackupAndRestore``, which can put a restarted fit back there, mid-epoch included.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from mirrored import checkpoint
from mirrored.input import global_batch_size_of
from mirrored.random import rng_state
from mirrored.replication.mirrored_module import MirroredModule
from mirrored.strategies.in_process import InProcessStrategy
from mirrored.training import saved_state
from mirrored.training.data_adapter import DataAdapter
from mirrored.training.evaluation import batch_logs, merge
from mirrored.training.loop import FitRequest, FitRun
from mirrored.training.saved_state import ModelParts

__all__ = ["ReplicatedEpochs", "ReplicatedLoop"]


class ReplicatedLoop:
    """The ``TrainingLoop`` of a strategy whose replicas are all in this job's processes."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.local_strategy = strategy

    def check_compile(self, module: nn.Module) -> None:
        """Every module trains here (a lazy one is built on its first batch)."""

    def own_module(self, replicas: Any, module: nn.Module) -> nn.Module:
        return replicas.module if isinstance(replicas, MirroredModule) else module

    def pull(self, replicas: Any) -> None:
        """Nothing to pull: the replicas here hold the trained parameters."""

    # -- fit ---------------------------------------------------------------------------------------
    def fit_epochs(self, request: FitRequest) -> ReplicatedEpochs:
        data = DataAdapter(
            request.x,
            request.y,
            request.sample_weight,
            request.batch_size,
            request.shuffle,
            request.steps_per_epoch,
            "fit",
            request.batch_dim,
        )
        return ReplicatedEpochs(self.strategy, data, request.initial_epoch)

    # -- saving ------------------------------------------------------------------------------------
    def save(self, parts: ModelParts, filepath: str | os.PathLike[str]) -> None:
        # Every worker gathers the state (the optimizer's may be sharded: zero_stage); the chief
        # writes it.
        state = {"format": saved_state.MODEL_FORMAT, **saved_state.training_state(parts)}
        self.strategy.save_on_chief(lambda: checkpoint.save(state, filepath))

    def load(self, parts: ModelParts, filepath: str | os.PathLike[str]) -> None:
        saved = checkpoint.load(filepath)
        if not isinstance(saved, dict) or saved.get("format") != saved_state.MODEL_FORMAT:
            raise ValueError(
                f"{str(filepath)!r} was not written by Model.save(); for weights only use "
                "load_weights()"
            )
        saved_state.load_training_state(parts, saved, repr(str(filepath)))
        self.strategy.check_same_on_workers(parts.module.state_dict(), f"{str(filepath)!r}")

    def load_weights(self, replicas: Any, module: nn.Module, weights: Any, source: str) -> None:
        checkpoint.load_module_state(replicas, weights, source)
        self.strategy.check_same_on_workers(module.state_dict(), source)


class ReplicatedEpochs:
    """A fit's epochs on the replicas here: each execution of batches through ``strategy.run``;
    fit keeps its place (epoch, batch, random state) for ``BackupAndRestore``, which can put a
    restarted fit back there, mid-epoch included."""

    def __init__(self, strategy: InProcessStrategy, data: DataAdapter, initial_epoch: int) -> None:
        self.strategy = strategy
        self.data = data
        self.steps_per_epoch = data.steps_per_epoch
        self._initial_epoch = initial_epoch
        self._resume: dict[str, Any] | None = None  # a restored backup, until its epoch runs

    def first_epoch(self, run: FitRun) -> int:
        # After a restore: the workers' optimizers and schedules are the same, or nothing runs.
        self.strategy.check_same_settings(run.steps.settings(), "optimizer settings in fit")
        self._resume, run.resume = run.resume, None
        if self._resume is None:
            return self._initial_epoch
        progress = self._resume["progress"]
        self.data.skip_consumed(progress["consumed"])
        if progress["step"] == 0:  # backed up at an epoch's end
            rng_state.restore(self._resume["rng"])
        return int(progress["epoch"])

    def train_epoch(self, run: FitRun, epoch: int) -> dict[str, Any] | None:
        """One epoch of training: its logs, or None when a one-shot iterator had run out."""
        data, resume, self._resume = self.data, self._resume, None
        steps, progress = run.steps, run.progress
        step, on_ready = _epoch_start(run, resume)
        run.position = {"epoch": epoch, "step": step, "consumed": data.consumed}
        ran = False
        for group in run.local.executions(data.epoch(skip=step, on_ready=on_ready)):
            ran = True
            run.callbacks.on_train_batch_begin(step)
            sizes = [global_batch_size_of(batch) or 0 for batch in group]
            state, loss_scale = self.strategy.run(
                steps.train, args=(group, sizes, progress.iterations, progress.loss_scale)
            )
            progress.loss_scale = self.strategy.experimental_local_results(loss_scale)[0]
            merge(self.strategy, steps.metrics, state)
            step += len(group)
            progress.iterations += len(group)
            run.position = {"epoch": epoch, "step": step, "consumed": data.consumed}
            logs = batch_logs(run.callbacks, "on_train_batch_end", steps.metrics, sum(sizes))
            run.callbacks.on_train_batch_end(step - 1, logs)
            if run.stop_training:
                break
        if not ran and step == 0:
            if data.one_shot and epoch > 0:
                warnings.warn(  # Keras: the iterator ran out of data
                    f"fit(): the input iterator ran out of data at epoch {epoch + 1}; training "
                    "stops (pass a re-iterable such as a DataLoader, or set steps_per_epoch so "
                    "that epochs * steps_per_epoch batches exist)",
                    stacklevel=4,
                )
                return None
            raise ValueError("fit(): the training data yielded no batches")
        run.position = {"epoch": epoch + 1, "step": 0, "consumed": data.consumed}
        run.epoch_rng = None
        return run.logs()

    def finish(self, run: FitRun) -> None:
        """Nothing to bring back: the replicas here hold the trained parameters."""


def _epoch_start(
    run: FitRun, resume: dict[str, Any] | None
) -> tuple[int, Callable[[], None] | None]:
    """The batch an epoch starts at, and what to call once its data order is drawn. Mid-epoch:
    the epoch's data order from its starting random state, the batches done skipped, then the
    random state as it was after the last of them."""
    if resume is None or resume["progress"]["step"] == 0:
        run.epoch_rng = rng_state.capture()
        return 0, None
    run.steps.metrics.load_state_dict(resume["metrics"])
    run.epoch_rng = resume["epoch_rng"]
    rng_state.restore(resume["epoch_rng"])

    def on_ready() -> None:
        rng_state.restore(resume["rng"])

    return resume["progress"]["step"], on_ready
