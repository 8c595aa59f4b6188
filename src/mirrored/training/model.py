"""``mirrored.Model``: Keras's compile / fit / evaluate / predict for a PyTorch module.

Written once against the Strategy contract, so it runs unchanged on every strategy. Create the
model inside ``strategy.scope()``; every global batch is split across the strategy's replicas,
and fit on N replicas ends with the parameters fit on one device ends with. Where fit's steps
and evaluate run and how a checkpoint is written is the model's ``TrainingLoop``, chosen once
from its strategy. This class holds the model's state and checks the user's arguments; the
loops, ``evaluation`` and ``saved_state`` do the work.

A module with lazy parameters (``nn.LazyLinear``, a Keras ``Dense`` without an input shape) is
built as Keras builds a model: on the first batch fit, evaluate or predict see, before it is
mirrored. Hugging Face models fit as they are: see ``Model.compile``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mirrored import checkpoint
from mirrored import optimizers as optimizers_module
from mirrored.callbacks.callback import Callback, CallbackList, FitPosition
from mirrored.callbacks.history import History
from mirrored.core import context
from mirrored.input import InputOptions
from mirrored.replication.mirror import MirroredModule, check_optimizer_params
from mirrored.training import arguments, evaluation, lazy_build, saved_state, trainer
from mirrored.training.data_adapter import DataAdapter
from mirrored.training.layers import Layer, find_layer, layer_table
from mirrored.training.loop import FitRequest, FitRun, LocalBatches, TrainingLoop, callback_list_for
from mirrored.training.parameter_server_fit import ParameterServerLoop
from mirrored.training.replicated_loop import ReplicatedLoop
from mirrored.training.saved_state import ModelParts, TrainingProgress
from mirrored.training.steps import Steps

__all__ = ["Model"]


def training_loop_for(strategy: Any) -> TrainingLoop:
    """The loop a model on ``strategy`` trains with: the contract says whether its steps are
    scheduled through a coordinator (``Strategy.should_use_with_coordinator``)."""
    if strategy.should_use_with_coordinator:
        return ParameterServerLoop(strategy)
    return ReplicatedLoop(strategy)


class Model:
    """A PyTorch module with Keras's training front-end, on the strategy of its scope."""

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Model(module): expected a torch.nn.Module, got {type(module)}")
        self.strategy = context.get_strategy()
        self.module = module
        self.stop_training = False
        self.history = History()
        self._loop = training_loop_for(self.strategy)
        self._replicas: Any = None  # the mirrored module, once mirrored
        self._optimizer: Any = None  # compile's torch optimizer, mirrored with the module
        self._sync_batch_norm = False
        self._steps: Steps | None = None
        self._steps_per_execution = 1
        self._progress = TrainingProgress()
        self._run: FitRun | None = None  # the fit() running now
        self._local = LocalBatches(self._loop.local_strategy, self._executions, self._set_training)

    # -- the torch side ----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward (replica 0), as calling a Keras model."""
        return self.module(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's parameters: build a torch optimizer on them before ``compile``."""
        return self.module.parameters(recurse)

    def state_dict(self) -> dict[str, Any]:
        """The module's state dict (identical on every replica; pulled from the ps tasks on a
        parameter-server strategy)."""
        self._loop.pull(self._replicas)
        return self.module.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into every replica; all keys and shapes must match, else nothing is loaded."""
        checkpoint.load_module_state(self._mirrored_module(), state_dict, "the state dict")

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The compiled torch optimizer (replica 0's; it drives every replica)."""
        if self._optimizer is None:
            return None
        return getattr(self._optimizer, "optimizer", self._optimizer)

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next update, as Keras's ``optimizer.learning_rate``: the
        schedule's there, else the first parameter group's (a torch scheduler has moved it)."""
        optimizer = self._compiled_optimizer()
        return self._compiled().learning_rate(optimizer, self._progress.iterations)

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        optimizer = self._compiled_optimizer()
        self._compiled().set_learning_rate(optimizer, value)

    def _compiled_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("the model is not compiled; call model.compile(...) first")
        return self.optimizer

    def _compiled(self) -> Steps:
        if self._steps is None:
            raise RuntimeError(
                "the model is not compiled; call model.compile(optimizer, loss) before fit() or "
                "evaluate()"
            )
        return self._steps

    # -- the module and its replicas ---------------------------------------------------------------
    def _mirrored_module(self) -> Any:
        """The mirrored module (with the compiled optimizer), mirrored on first use."""
        if self._replicas is not None:
            return self._replicas
        if lazy_build.has_lazy_parameters(self.module):
            raise saved_state.not_built(self.module)
        if self._steps is None:
            self._replicas = self.strategy.mirror(self.module)
            return self._replicas
        replicas, mirrored_optimizer = self.strategy.mirror(
            self.module, self._optimizer, sync_batch_norm=self._sync_batch_norm
        )
        self.module = self._loop.own_module(replicas, self.module)
        self._replicas, self._optimizer = replicas, mirrored_optimizer
        self._steps.module, self._steps.optimizer = replicas, mirrored_optimizer
        return replicas

    def _replica_modules(self) -> list[nn.Module]:
        """Every local copy of the module: the replicas once mirrored, else the module."""
        if isinstance(self._replicas, MirroredModule):
            return list(self._replicas.replicas)
        return [self.module]

    def _set_training(self, mode: bool) -> None:
        (self.module if self._replicas is None else self._replicas).train(mode)

    def _executions(self, batches: Iterator[Any]) -> Iterator[list[Any]]:
        """Distributed batches, ``steps_per_execution`` at a time (the module built on the
        first and mirrored, when it has lazy parameters)."""
        if self._replicas is None and lazy_build.has_lazy_parameters(self.module):
            first = next(batches, None)
            if first is None:
                return
            lazy_build.build(self.module, first[0])
            batches = itertools.chain([first], batches)
        self._mirrored_module()
        strategy = self._loop.local_strategy
        options = None if self._steps is None else self._steps.input_options
        distributed = iter(strategy.experimental_distribute_dataset(batches, options))
        while group := list(itertools.islice(distributed, self._steps_per_execution)):
            yield group

    def _parts(self) -> ModelParts:
        steps = self._compiled()
        return ModelParts(
            module=self.module,
            replicas=self._replicas,
            optimizer=self._optimizer,
            torch_optimizer=self._compiled_optimizer(),
            steps=steps,
            progress=self._progress,
        )

    # -- Keras's layer access ----------------------------------------------------------------------
    def get_layer(self, name: str | None = None, index: int | None = None) -> Layer:
        """A layer by name (any submodule's dotted name from ``named_modules``, e.g.
        ``"encoder.layer.0"``) or by index among the top-level children, as Keras's
        ``get_layer``. Setting its ``trainable`` to False freezes it on every replica."""
        return find_layer(self, self.module, name, index)

    # -- compile -----------------------------------------------------------------------------------
    def compile(
        self,
        optimizer: str | optimizers_module.Optimizer | torch.optim.Optimizer = "adam",
        loss: Any = None,
        metrics: Sequence[Any] | None = None,
        weighted_metrics: Sequence[Any] | None = None,
        steps_per_execution: int = 1,
        precision: str = "32",
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        sync_batch_norm: bool = False,
        input_options: InputOptions | None = None,
        jit_compile: bool = False,
    ) -> None:
        """Choose the optimizer, loss and metrics, and mirror the module on the strategy (a
        module with lazy parameters: on the first batch, once they are built).

        ``optimizer``: a name ("adam", "sgd", "adamw", "rmsprop"), a ``mirrored.optimizers``
        object (its learning rate may be a schedule), or a torch optimizer built on
        ``model.parameters()``. ``loss``: a name, a ``mirrored.losses`` object or function, or a
        callable returning per-example losses; for a model returning a mapping (a Hugging Face
        ``ModelOutput``) it takes the ``logits``; ``None`` trains on the model's own ``loss``,
        a mean over each shard's labels that are not -100 (or its examples), weighted to the
        global batch's mean. ``metrics`` / ``weighted_metrics``: a list, or one metric; without
        y in the data they compare the logits with ``x["labels"]``, its -100 positions
        weighted 0 (a causal language model's logits at position t with the labels at t + 1,
        the positions its own loss compares). ``precision``: "32", "bf16-mixed" or "16-mixed"
        (autocast; float16 adds dynamic loss scaling; the weights stay float32).
        ``lr_scheduler``: a torch LR scheduler on that optimizer, stepped after every update.
        ``steps_per_execution``: batches per ``strategy.run`` (callbacks' batch hooks run once
        per execution). ``input_options``: how fit, evaluate and predict read batches
        (``InputOptions``): ``batch_dim=1`` for a sequence-first model, whose inputs, targets,
        weights and predictions carry the batch in dim 1 (read-ahead is refused).
        ``jit_compile``: each replica's step traced and replayed (:func:`mirrored.function`).
        """
        arguments.check_can_compile(self.strategy, fitting=self._run is not None)
        loss_object, compiled_metrics = arguments.loss_and_metrics(loss, metrics, weighted_metrics)
        arguments.positive_int("steps_per_execution", steps_per_execution)
        arguments.check_precision(precision, self.strategy)
        options = arguments.checked_input_options(input_options)
        self._loop.check_compile(self.module)
        # A torch optimizer on lazy parameters keeps working: torch materialises the parameter
        # objects in place.
        torch_optimizer, schedule = arguments.build_optimizer(optimizer, self.module)
        arguments.check_lr_scheduler(lr_scheduler, torch_optimizer, schedule)
        check_optimizer_params(self.module, torch_optimizer)
        # Everything is checked: from here on the model changes, all of it.
        steps = Steps(
            module=None,
            optimizer=None,
            loss=loss_object,
            metrics=compiled_metrics,
            precision=precision,
            schedule=schedule,
            lr_scheduler=lr_scheduler,
            input_options=options,
            jit_compile=arguments.boolean("jit_compile", jit_compile),
        )
        self._install(steps, torch_optimizer, steps_per_execution, sync_batch_norm)

    def _install(
        self,
        steps: Steps,
        torch_optimizer: torch.optim.Optimizer,
        steps_per_execution: int,
        sync_batch_norm: bool,
    ) -> None:
        """A checked compile takes effect: the previous mirror is released, and the module is
        mirrored anew with the new optimizer (a lazy one once it is built)."""
        if isinstance(self._replicas, MirroredModule):
            self._replicas.release()
        self._steps = steps
        self._steps_per_execution = steps_per_execution
        self._replicas, self._optimizer = None, torch_optimizer
        self._sync_batch_norm = sync_batch_norm
        if not lazy_build.has_lazy_parameters(self.module):
            self._mirrored_module()
        self._progress = TrainingProgress()

    # -- fit ---------------------------------------------------------------------------------------
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: int | str = "auto",
        callbacks: Sequence[Callback] | None = None,
        validation_data: Any = None,
        shuffle: bool = True,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_freq: int | Sequence[int] = 1,
        sample_weight: Any = None,
    ) -> History:
        """Train for ``epochs`` epochs (Keras's arguments); returns the ``History``.

        On a ``ParameterServerStrategy``, ``x`` is arrays (each worker takes every n-th
        example) or a ``dataset_fn(InputContext)`` that builds a worker's batches there, and
        ``steps_per_epoch`` is required (``mirrored.training.parameter_server_fit``)."""
        batch_dim = self._compiled().input_options.batch_dim
        if self._run is not None:
            raise RuntimeError("fit() was called while fit() is running (from a callback?)")
        arguments.positive_int("epochs", epochs)
        if not isinstance(initial_epoch, int) or initial_epoch < 0:
            raise ValueError(f"initial_epoch={initial_epoch!r}: expected an int >= 0")
        if steps_per_epoch is not None:
            arguments.positive_int("steps_per_epoch", steps_per_epoch)
        request = FitRequest(
            x=x,
            y=y,
            sample_weight=sample_weight,
            batch_size=batch_size,
            batch_dim=batch_dim,
            shuffle=shuffle,
            epochs=epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            verbose=arguments.resolve_verbose(verbose),
            callbacks=callbacks,
            validation=arguments.validation_adapter(validation_data, batch_size, batch_dim),
            validate_at=arguments.validation_schedule(validation_freq),
        )
        prepared = self._loop.fit_epochs(request)
        trainer.fit(prepared, epochs, lambda steps: self._fitting(request, steps))
        return self.history

    @contextlib.contextmanager
    def _fitting(self, request: FitRequest, steps_per_epoch: int | None) -> Iterator[FitRun]:
        """A fit's run, with the model marked as fitting until the loop ends however it ends."""
        callback_list = callback_list_for(self, request.callbacks, request.verbose, True)
        callback_list.set_params(
            {"epochs": request.epochs, "steps": steps_per_epoch, "verbose": request.verbose}
        )
        self._run = FitRun(
            model=self,
            steps=self._compiled(),
            progress=self._progress,
            callbacks=callback_list,
            request=request,
            local=self._local,
            evaluate=self._test_loop,
            position={"epoch": request.initial_epoch, "step": 0, "consumed": 0},
        )
        self.stop_training = False
        try:
            yield self._run
        finally:
            self._run = None
            self._set_training(False)

    # -- for BackupAndRestore ----------------------------------------------------------------------
    def callbacks_in_fit(self) -> list[Callback]:
        """The callbacks of the running fit, in the order they are called (none outside fit)."""
        return [] if self._run is None else list(self._run.callbacks.callbacks)

    def fit_position(self) -> FitPosition:
        """Where fit is (epoch, batches done in it, batches consumed from a one-shot iterator),
        the random state of the epoch's start, and the epoch's running metrics."""
        run = self._fit_run()
        return dict(run.position), run.epoch_rng, run.steps.metrics.state_dict()

    def resume_fit(
        self,
        progress: dict[str, Any],
        rng: dict[str, Any],
        epoch_rng: dict[str, Any] | None,
        metrics: list[Any],
    ) -> None:
        """From ``on_train_begin`` (``BackupAndRestore``): fit continues at ``progress``, with
        the random states and running metrics saved there."""
        self._fit_run().resume = {
            "progress": progress,
            "rng": rng,
            "epoch_rng": epoch_rng,
            "metrics": metrics,
        }

    def preemption_requested(self) -> bool:
        """Whether the job is being preempted (SIGTERM on any worker) while fit runs with a
        ``BackupAndRestore``: a collective, asked at a step boundary."""
        return self._run is not None and self._run.preemption_requested()

    def _fit_run(self) -> FitRun:
        if self._run is None:
            raise RuntimeError("a fit position can only be read or restored while fit() runs")
        return self._run

    # -- evaluate and predict ----------------------------------------------------------------------
    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[Callback] | None = None,
        return_dict: bool = False,
    ) -> Any:
        """Loss and metrics on the data: a float (loss only), a list ``[loss, metrics...]``, or
        with ``return_dict`` a dict."""
        batch_dim = self._compiled().input_options.batch_dim
        if self._run is not None:
            raise RuntimeError(
                "evaluate() was called during fit() (from a callback?): it would reset the "
                "epoch's metrics; pass validation_data to fit() instead"
            )
        data = DataAdapter(x, y, sample_weight, batch_size, False, steps, "evaluate", batch_dim)
        callback_list = self._callbacks_for_one_pass(callbacks, verbose, data)
        logs = self._test_loop(data, callback_list)
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def _test_loop(self, data: DataAdapter, callback_list: CallbackList) -> dict[str, Any]:
        steps = self._compiled()
        self._loop.pull(self._replicas)
        was_training = self._run is not None
        return evaluation.run_evaluate(
            steps, self._local, data.epoch(), callback_list, was_training
        )

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        steps: int | None = None,
        callbacks: Sequence[Callback] | None = None,
    ) -> Any:
        """The model's outputs for every example, concatenated in order, on the CPU (a tensor,
        or the structure the module returns; of a mapping such as a Hugging Face
        ``ModelOutput``, a dict of its per-example entries: no mean loss, no cache)."""
        batch_dim = self._predict_steps().input_options.batch_dim
        data = DataAdapter(x, None, None, batch_size, False, steps, "predict", batch_dim)
        callback_list = self._callbacks_for_one_pass(callbacks, verbose, data)
        self._loop.pull(self._replicas)
        was_training = bool(self.module.training)
        return evaluation.run_predict(
            self._predict_steps, self._local, data.epoch(), callback_list, was_training
        )

    def _predict_steps(self) -> Steps:
        if self._steps is not None:
            return self._steps
        return evaluation.predict_only(self._replicas)

    def _callbacks_for_one_pass(
        self, callbacks: Sequence[Callback] | None, verbose: int | str, data: DataAdapter
    ) -> CallbackList:
        verbose = arguments.resolve_verbose(verbose)
        callback_list = callback_list_for(self, callbacks, verbose, with_history=False)
        callback_list.set_params({"epochs": 1, "steps": data.steps_per_epoch, "verbose": verbose})
        return callback_list

    # -- saving ------------------------------------------------------------------------------------
    def training_state(self) -> dict[str, Any]:
        """Model, optimizer, schedule, step count and loss scale, as plain data. With a
        sharded optimizer state (``zero_stage``) across workers this gathers it: a collective,
        so call it on every worker at the same point (``save`` and ``BackupAndRestore`` do)."""
        return saved_state.training_state(self._parts())

    def load_training_state(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        """Restore what ``training_state`` returned; all or nothing: every part is checked
        against this model first (``mirrored.training.saved_state``)."""
        saved_state.load_training_state(self._parts(), state, source)

    def save(self, filepath: str | Path, allow_non_finite: bool = False) -> None:
        """Write the whole training state (``load`` restores it), atomically; only where the
        strategy writes checkpoints (the chief). Weights holding a NaN or an infinity are
        refused (a ValueError naming the entry; the file on disk stays) unless
        ``allow_non_finite``. On a ``ParameterServerStrategy`` the file is the coordinator's
        checkpoint of this model on the ps tasks (``ClusterCoordinator.save`` of it alone)."""
        if not allow_non_finite:
            saved_state.refuse_non_finite(self.state_dict(), filepath)
        self._loop.save(self._parts(), filepath)

    def load(self, filepath: str | Path) -> None:
        """Restore a file written by ``save`` into this compiled model."""
        self._loop.load(self._parts(), filepath)

    def save_weights(self, filepath: str | Path, allow_non_finite: bool = False) -> None:
        """Write the module's state dict (a plain ``torch.load``-able file), atomically; only
        where the strategy writes checkpoints (the chief). Weights holding a NaN or an infinity
        are refused as by ``save``, unless ``allow_non_finite``."""
        weights = self.state_dict()
        if not allow_non_finite:
            saved_state.refuse_non_finite(weights, filepath)
        self.strategy.save_on_chief(lambda: checkpoint.save(weights, filepath))

    def load_weights(self, filepath: str | Path) -> None:
        """Load weights from ``save_weights`` or ``save`` files (a parameter-server job's too)
        into every replica; a file that does not fit the model raises and loads nothing."""
        weights = saved_state.weights_in(checkpoint.load(filepath), filepath)
        replicas = self._mirrored_module()
        self._loop.load_weights(replicas, self.module, weights, repr(str(filepath)))

    # -- summary ---------------------------------------------------------------------------------
    def summary(self, print_fn: Callable[[str], Any] | None = print) -> str:
        """A table of the module's top-level layers and parameter counts; printed and returned."""
        text = layer_table(self.module, self.strategy)
        if print_fn is not None:
            print_fn(text)
        return text
