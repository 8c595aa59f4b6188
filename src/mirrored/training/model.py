"""``mirrored.Model``: Keras's compile / fit / evaluate / predict for a PyTorch module.

Written once against the Strategy contract (``scope``, ``mirror``, ``run``, ``reduce``,
``gather``, ``experimental_distribute_dataset``), so it runs unchanged on the default one-device
strategy, on ``MirroredStrategy`` and on the multi-worker strategy. Create the model inside
``strategy.scope()``; every global batch is split across the strategy's replicas, and fit on N
replicas ends with the parameters fit on one device ends with.

A module with lazy parameters (``nn.LazyLinear``, what a Keras ``Dense`` without an input shape
becomes) is built as Keras builds a model: on the first batch fit, evaluate or predict see, before
it is mirrored. Hugging Face models fit as they are: see ``Model.compile``.

On a ``ParameterServerStrategy`` fit schedules its steps on the workers
(``mirrored.training.parameter_server_fit``); evaluate and predict run on the coordinator's copy
of the model, pulled from the ps tasks; ``save`` and ``load`` go through the coordinator.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mirrored import checkpoint, context, parameter_server_checkpoint, rng_state, state_checks
from mirrored import losses as losses_module
from mirrored import metrics as metrics_module
from mirrored import optimizers as optimizers_module
from mirrored.callbacks.backup_and_restore import BackupAndRestore
from mirrored.callbacks.callback import Callback, CallbackList
from mirrored.callbacks.history import History
from mirrored.callbacks.progbar_logger import ProgbarLogger
from mirrored.input import global_batch_size_of
from mirrored.mirror import MirroredModule, check_optimizer_params
from mirrored.strategy import Strategy, default_strategy
from mirrored.training import saved_state
from mirrored.training.data_adapter import DataAdapter, _is_array_structure
from mirrored.training.layers import Layer, find_layer
from mirrored.training.loss_scale import LossScale
from mirrored.training.metric_set import MetricSet
from mirrored.training.steps import (
    PRECISIONS,
    Steps,
    call_module,
    cast_images,
    floating_dtype,
    to_device,
)
from mirrored.values import ReduceOp, map_structure

__all__ = ["Model"]

_MODEL_FORMAT = "mirrored.model/1"


def _resolve_verbose(verbose: int | str) -> int:
    if verbose == "auto":
        return 1 if sys.stdout.isatty() else 2
    if verbose not in (0, 1, 2) or isinstance(verbose, bool):
        raise ValueError(f"verbose={verbose!r}: expected 'auto', 0, 1 or 2")
    return int(verbose)


def _has_lazy_parameters(module: nn.Module) -> bool:
    return any(
        torch.nn.parameter.is_lazy(t)
        for t in itertools.chain(module.parameters(), module.buffers())
    )


def _metric_set(
    metrics: Sequence[metrics_module.Metric], weighted: Sequence[metrics_module.Metric]
) -> MetricSet:
    """The compiled metrics; a weighted metric whose name another one (or the loss) has is
    logged as ``weighted_<name>``."""
    taken = {m.name for m in metrics} | {"loss"}
    for metric in weighted:
        if metric.name in taken:
            metric.name = f"weighted_{metric.name}"
    return MetricSet(metrics, weighted)


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r}: expected a positive int")
    return value


class Model:
    """A PyTorch module with Keras's training front-end, on the strategy of its scope."""

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Model(module): expected a torch.nn.Module, got {type(module)}")
        self.strategy = context.get_strategy()
        self.module = module
        self.stop_training = False
        self.history = History()
        self._replicas: Any = None  # the mirrored module, once mirrored
        self._optimizer: Any = None  # compile's torch optimizer, mirrored with the module
        self._sync_batch_norm = False
        self._steps: Steps | None = None
        self._steps_per_execution = 1
        self._iterations = 0
        self._loss_scale = LossScale()
        self._callbacks: list[Callback] = []
        self._in_fit = False
        self._position: dict[str, Any] = {"epoch": 0, "step": 0, "consumed": 0}  # fit's place
        self._epoch_rng: dict[str, Any] | None = None
        self._resume: dict[str, Any] | None = None
        self._coordinator: Any = None  # a ParameterServerStrategy's ClusterCoordinator

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
        self._pull()
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
        assert self._steps is not None
        if self._steps.schedule is not None:
            return self._steps.scheduled_learning_rate(self._iterations)
        return float(optimizer.param_groups[0]["lr"])

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        optimizer = self._compiled_optimizer()
        assert self._steps is not None
        if self._steps.schedule is not None or self._steps.lr_scheduler is not None:
            raise ValueError(
                "the learning rate is driven by a schedule given to compile(); it cannot also "
                "be set directly"
            )
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"learning_rate={value!r}: expected a non-negative number")
        for group in optimizer.param_groups:
            group["lr"] = float(value)

    def _compiled_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("the model is not compiled; call model.compile(...) first")
        return self.optimizer

    @property
    def _on_parameter_servers(self) -> bool:
        return bool(getattr(self.strategy, "runs_on_parameter_servers", False))

    @property
    def _local_strategy(self) -> Strategy:
        """Where evaluate and predict run: the strategy, or on a parameter-server strategy
        the coordinator's own copy of the model (the default strategy)."""
        return default_strategy() if self._on_parameter_servers else self.strategy

    def _parameter_server_coordinator(self) -> Any:
        if self._coordinator is None:
            from mirrored.cluster_coordinator import ClusterCoordinator

            self._coordinator = ClusterCoordinator(self.strategy)  # type: ignore[arg-type]
        return self._coordinator

    def _pull(self) -> None:
        """On a parameter-server strategy, bring the ps tasks' parameters into the copy here."""
        if self._on_parameter_servers and self._replicas is not None:
            self._replicas.pull()

    def _mirrored_module(self) -> Any:
        """The mirrored module (with the compiled optimizer), mirrored on first use."""
        if self._replicas is not None:
            return self._replicas
        if _has_lazy_parameters(self.module):
            raise RuntimeError(
                f"the module ({type(self.module).__name__}) has lazy parameters that are not "
                "built yet; fit, evaluate and predict build them on their first batch (or call "
                "the module once on an example batch before this)"
            )
        if self._steps is None:
            self._replicas = self.strategy.mirror(self.module)
            return self._replicas
        replicas, mirrored_optimizer = self.strategy.mirror(
            self.module, self._optimizer, sync_batch_norm=self._sync_batch_norm
        )
        if isinstance(replicas, MirroredModule) or self._on_parameter_servers:
            self.module = replicas.module
        self._replicas, self._optimizer = replicas, mirrored_optimizer
        self._steps.module, self._steps.optimizer = replicas, mirrored_optimizer
        return replicas

    def _replica_modules(self) -> list[nn.Module]:
        """Every local copy of the module: the replicas once mirrored, else the module."""
        if isinstance(self._replicas, MirroredModule):
            return list(self._replicas.replicas)
        return [self.module]

    def _build(self, x: Any) -> None:
        """Materialise lazy parameters, as Keras builds a model on its first call: the module
        runs once on the first example of ``x`` (no grad, in eval mode so that no dropout or
        batch statistics move, before any replica exists)."""
        module = self.module
        device = next(itertools.chain(module.parameters(), module.buffers())).device
        example = map_structure(
            lambda v: v[:1] if isinstance(v, torch.Tensor) and v.dim() else v, x
        )
        example = cast_images(to_device(example, device), floating_dtype(module))
        training = module.training
        module.train(False)
        try:
            with torch.no_grad():
                call_module(module, example)
        finally:
            module.train(training)
        if _has_lazy_parameters(module):
            raise ValueError(
                f"the module ({type(module).__name__}) still has lazy parameters after a forward "
                "on the first example: a lazy layer its forward does not reach cannot be built; "
                "give that layer its input size"
            )

    def _built_on(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, the module built on the first one when its parameters are lazy, and
        mirrored."""
        if self._replicas is None and _has_lazy_parameters(self.module):
            first = next(batches, None)
            if first is None:
                return iter(())
            self._build(first[0])
            batches = itertools.chain([first], batches)
        self._mirrored_module()
        return batches

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
        per execution).
        """
        self._check_can_compile()
        loss_object = self._compiled_loss(loss)
        _positive_int("steps_per_execution", steps_per_execution)
        self._check_precision(precision)
        compiled_metrics = self._metrics("metrics", metrics, loss_object)
        compiled_weighted = self._metrics("weighted_metrics", weighted_metrics, loss_object)
        lazy = _has_lazy_parameters(self.module)
        if lazy and self._on_parameter_servers:
            raise ValueError(
                "the module has lazy parameters, which a ParameterServerStrategy cannot build on "
                "its workers; call the module once on an example batch before compile()"
            )
        # A torch optimizer on lazy parameters keeps working: torch materialises the parameter
        # objects in place.
        torch_optimizer, schedule = self._build_optimizer(optimizer)
        self._check_lr_scheduler(lr_scheduler, torch_optimizer, schedule)
        check_optimizer_params(self.module, torch_optimizer)
        # Everything is checked: from here on the model changes, all of it.
        steps = Steps(
            module=None,
            optimizer=None,
            loss=loss_object,
            metrics=_metric_set(compiled_metrics, compiled_weighted),
            precision=precision,
            schedule=schedule,
            lr_scheduler=lr_scheduler,
        )
        self._install(steps, torch_optimizer, steps_per_execution, sync_batch_norm, lazy)

    def _check_can_compile(self) -> None:
        current = context.get_strategy()
        if context.has_strategy() and current is not self.strategy:
            raise ValueError(
                f"compile() was called in the scope of {current}, but the model was created "
                f"under {self.strategy}; create and compile the model in the same scope"
            )
        if self._in_fit:
            raise RuntimeError("compile() was called during fit(); compile before fit")

    @staticmethod
    def _compiled_loss(loss: Any) -> losses_module.Loss | None:
        loss_object = None if loss is None else losses_module.get(loss)
        if getattr(loss_object, "ignore_class", None) is not None:
            raise ValueError(
                "compile() does not take a loss with ignore_class yet (fit averages over every "
                "position of the global batch); give the ignored positions sample_weight 0"
            )
        return loss_object

    def _check_precision(self, precision: str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {sorted(PRECISIONS)}")
        if precision == "16-mixed" and not self.strategy.gradients_after_backward:
            raise ValueError(
                f"precision='16-mixed' unscales gradients between backward and the optimizer "
                f"step, where {type(self.strategy).__name__} has not summed them yet; use "
                "precision='bf16-mixed' (no loss scaling) or '32'"
            )

    def _install(
        self,
        steps: Steps,
        torch_optimizer: torch.optim.Optimizer,
        steps_per_execution: int,
        sync_batch_norm: bool,
        lazy: bool,
    ) -> None:
        """A checked compile takes effect: the previous mirror is released, and the module is
        mirrored anew with the new optimizer (a lazy one once it is built)."""
        if isinstance(self._replicas, MirroredModule):
            self._replicas.release()
        self._steps = steps
        self._steps_per_execution = steps_per_execution
        self._replicas, self._optimizer = None, torch_optimizer
        self._sync_batch_norm = sync_batch_norm
        if not lazy:
            self._mirrored_module()
        self._iterations = 0
        self._loss_scale = LossScale()

    @staticmethod
    def _metrics(argument: str, metrics: Any, loss: Any) -> list[metrics_module.Metric]:
        if metrics is None:
            return []
        if isinstance(metrics, metrics_module.Metric) or (
            callable(metrics) and not isinstance(metrics, Iterable)
        ):
            metrics = [metrics]  # one metric, as TensorFlow's Keras took it
        if isinstance(metrics, (str, dict)) or not isinstance(metrics, Iterable):
            raise TypeError(
                f"{argument}={metrics!r}: expected a list of metrics, e.g. "
                f"{argument}=[{metrics!r}], or one metric object"
            )
        resolved = [metrics_module.get(m, loss) for m in metrics]
        for metric in resolved:
            if type(metric) is metrics_module.Mean:
                raise TypeError(
                    f"{argument}: Mean() averages the values you give it and cannot be compiled; "
                    "compile a metric of (y_true, y_pred), e.g. 'mae' or MeanMetricWrapper(fn)"
                )
        return resolved

    def _build_optimizer(self, optimizer: Any) -> tuple[torch.optim.Optimizer, Any]:
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer, None
        spec = optimizers_module.get(optimizer)
        torch_optimizer = spec.build(self.module.parameters())
        return torch_optimizer, spec if spec.is_scheduled else None

    @staticmethod
    def _check_lr_scheduler(
        lr_scheduler: Any, optimizer: torch.optim.Optimizer, schedule: Any
    ) -> None:
        if lr_scheduler is None:
            return
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "ReduceLROnPlateau needs a metric, not a step count; use a callback that calls "
                "it at epoch end instead of compile(lr_scheduler=...)"
            )
        if not isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(
                f"lr_scheduler must be a torch.optim.lr_scheduler.LRScheduler, got "
                f"{type(lr_scheduler).__name__}"
            )
        if lr_scheduler.optimizer is not optimizer:
            raise ValueError(
                "lr_scheduler is attached to another optimizer; build it on the optimizer you "
                "pass to compile() (a torch optimizer built on model.parameters())"
            )
        if schedule is not None:
            raise ValueError(
                "the optimizer's learning_rate is already a schedule; pass either a schedule or "
                "lr_scheduler, not both"
            )

    def _compiled(self) -> Steps:
        if self._steps is None:
            raise RuntimeError(
                "the model is not compiled; call model.compile(optimizer, loss) before fit() or "
                "evaluate()"
            )
        return self._steps

    # -- running executions ------------------------------------------------------------------------
    def _executions(self, batches: Iterator[Any]) -> Iterator[list[Any]]:
        """Distributed batches, ``steps_per_execution`` at a time (the module built on the
        first and mirrored, when it has lazy parameters)."""
        batches = self._built_on(batches)
        distributed = iter(self._local_strategy.experimental_distribute_dataset(batches))
        while group := list(itertools.islice(distributed, self._steps_per_execution)):
            yield group

    def _merge(self, state: Any) -> None:
        """Add the replicas' partial sums to the metrics' running total (on the device: no
        host copy until a result is read)."""
        self._compiled().metrics.add(self._local_strategy.reduce(ReduceOp.SUM, state, axis=None))

    def _logs(self, num_examples: int | None = None) -> dict[str, Any]:
        logs: dict[str, Any] = self._compiled().metrics.results()
        if num_examples is not None:
            logs["num_examples"] = num_examples
        return logs

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
        steps = self._compiled()
        if self._in_fit:
            raise RuntimeError("fit() was called while fit() is running (from a callback?)")
        _positive_int("epochs", epochs)
        if not isinstance(initial_epoch, int) or initial_epoch < 0:
            raise ValueError(f"initial_epoch={initial_epoch!r}: expected an int >= 0")
        if steps_per_epoch is not None:
            _positive_int("steps_per_epoch", steps_per_epoch)
        validation = self._validation_adapter(validation_data, batch_size)
        validate_at = self._validation_schedule(validation_freq)
        verbose = _resolve_verbose(verbose)
        if self._on_parameter_servers:
            from mirrored.training import parameter_server_fit

            return parameter_server_fit.fit(
                self,
                x,
                y,
                batch_size,
                epochs,
                verbose,
                callbacks,
                validation,
                validate_at,
                shuffle,
                initial_epoch,
                steps_per_epoch,
                sample_weight,
            )
        data = DataAdapter(x, y, sample_weight, batch_size, shuffle, steps_per_epoch, "fit")
        self._resume = None
        self._position = {"epoch": initial_epoch, "step": 0, "consumed": 0}
        with self._fitting(callbacks, verbose, epochs, data.steps_per_epoch) as callback_list:
            callback_list.on_train_begin()
            first_epoch = initial_epoch
            resume, self._resume = self._resume, None
            if resume is not None:
                first_epoch = resume["progress"]["epoch"]
                data.skip_consumed(resume["progress"]["consumed"])
                if resume["progress"]["step"] == 0:  # backed up at an epoch's end
                    rng_state.restore(resume["rng"])
            epoch_logs: dict[str, Any] = {}
            for epoch in range(first_epoch, epochs):
                steps.metrics.reset()
                self._set_training(True)
                callback_list.on_epoch_begin(epoch)
                trained = self._train_epoch(epoch, data, callback_list, resume)
                resume = None
                if trained is None:  # a one-shot iterator ran out: no epoch to report
                    break
                epoch_logs = trained
                self._position = {"epoch": epoch + 1, "step": 0, "consumed": data.consumed}
                self._epoch_rng = None
                self._end_epoch(epoch, epoch_logs, validation, validate_at, callback_list)
                if self.stop_training:
                    break
            callback_list.on_train_end(epoch_logs)
        return self.history

    @contextlib.contextmanager
    def _fitting(
        self, callbacks: Any, verbose: int, epochs: int, steps: int | None
    ) -> Iterator[CallbackList]:
        """A fit loop's callbacks, with the model marked as fitting until the loop ends however it
        ends (every fit loop, whatever the strategy)."""
        callback_list = self._callback_list(callbacks, verbose, with_history=True)
        self._callbacks = list(callback_list.callbacks)
        callback_list.set_params({"epochs": epochs, "steps": steps, "verbose": verbose})
        self._in_fit = True
        self.stop_training = False
        try:
            yield callback_list
        finally:
            self._in_fit = False
            self._callbacks = []
            self._set_training(False)

    def _end_epoch(
        self,
        epoch: int,
        logs: dict[str, Any],
        validation: DataAdapter | None,
        validate_at: Callable[[int], bool],
        callback_list: CallbackList,
    ) -> None:
        """Completes an epoch's logs (validation figures when due, the learning rate) and hands
        them to the callbacks: the end of every fit loop, whatever the strategy."""
        if validation is not None and validate_at(epoch):
            validation_logs = self._test_loop(validation, callback_list)
            logs.update({f"val_{k}": v for k, v in validation_logs.items()})
        logs["learning_rate"] = self.learning_rate
        callback_list.on_epoch_end(epoch, logs)

    def _train_epoch(
        self,
        epoch: int,
        data: DataAdapter,
        callback_list: CallbackList,
        resume: dict[str, Any] | None,
    ) -> dict[str, Any] | None:
        """One epoch of training: its logs, or None when a one-shot iterator had run out."""
        steps = self._compiled()
        step = 0
        on_ready: Callable[[], None] | None = None
        if resume is not None and resume["progress"]["step"] > 0:
            # Mid-epoch: the epoch's data order from its starting random state, the batches done
            # skipped, then the random state as it was after the last of them.
            step = resume["progress"]["step"]
            steps.metrics.load_state_dict(resume["metrics"])
            self._epoch_rng = resume["epoch_rng"]
            rng_state.restore(resume["epoch_rng"])

            def on_ready() -> None:
                rng_state.restore(resume["rng"])

        else:
            self._epoch_rng = rng_state.capture()
        self._position = {"epoch": epoch, "step": step, "consumed": data.consumed}
        ran = False
        for group in self._executions(data.epoch(skip=step, on_ready=on_ready)):
            ran = True
            callback_list.on_train_batch_begin(step)
            sizes = [global_batch_size_of(batch) or 0 for batch in group]
            state, loss_scale = self.strategy.run(
                steps.train, args=(group, sizes, self._iterations, self._loss_scale)
            )
            self._loss_scale = self.strategy.experimental_local_results(loss_scale)[0]
            self._merge(state)
            step += len(group)
            self._iterations += len(group)
            self._position = {"epoch": epoch, "step": step, "consumed": data.consumed}
            callback_list.on_train_batch_end(step - 1, steps.metrics.batch_logs(sum(sizes)))
            if self.stop_training:
                break
        if not ran and step == 0:
            if data.one_shot and epoch > 0:
                warnings.warn(  # Keras: the iterator ran out of data
                    f"fit(): the input iterator ran out of data at epoch {epoch + 1}; training "
                    "stops (pass a re-iterable such as a DataLoader, or set steps_per_epoch so "
                    "that epochs * steps_per_epoch batches exist)",
                    stacklevel=3,
                )
                return None
            raise ValueError("fit(): the training data yielded no batches")
        return self._logs()

    def _set_training(self, mode: bool) -> None:
        (self.module if self._replicas is None else self._replicas).train(mode)

    def _validation_adapter(self, validation_data: Any, batch_size: int | None) -> Any:
        if validation_data is None:
            return None
        if isinstance(validation_data, (tuple, list)) and all(
            v is None or _is_array_structure(v) for v in validation_data
        ):
            if len(validation_data) not in (2, 3):
                raise ValueError(
                    f"validation_data is a {type(validation_data).__name__} of "
                    f"{len(validation_data)} items; expected (x_val, y_val) or "
                    "(x_val, y_val, val_sample_weight)"
                )
            weight = validation_data[2] if len(validation_data) == 3 else None
            return DataAdapter(
                validation_data[0], validation_data[1], weight, batch_size, purpose="evaluate"
            )
        return DataAdapter(validation_data, purpose="evaluate")

    @staticmethod
    def _validation_schedule(validation_freq: Any) -> Callable[[int], bool]:
        if isinstance(validation_freq, int) and not isinstance(validation_freq, bool):
            frequency = _positive_int("validation_freq", validation_freq)
            return lambda epoch: (epoch + 1) % frequency == 0
        if isinstance(validation_freq, (list, tuple, set, range)):
            epochs = set(validation_freq)
            return lambda epoch: epoch + 1 in epochs
        raise ValueError(
            f"validation_freq={validation_freq!r}: expected a positive int (every N epochs) or "
            "a collection of 1-based epochs"
        )

    def _callback_list(
        self, callbacks: Sequence[Callback] | None, verbose: int, with_history: bool
    ) -> CallbackList:
        """History first, the user's callbacks, backups after them (so an epoch's backup has
        what they recorded for it), the progress bar last."""
        given = list(callbacks or [])
        if not all(isinstance(c, Callback) for c in given):
            CallbackList(given)  # raises the TypeError naming the wrong one
        ordered: list[Callback] = []
        if with_history:
            self.history = History()
            ordered.append(self.history)
        ordered += [c for c in given if not isinstance(c, BackupAndRestore)]
        ordered += [c for c in given if isinstance(c, BackupAndRestore)]
        if verbose:
            ordered.append(ProgbarLogger())
        callback_list = CallbackList(ordered)
        callback_list.set_model(self)
        return callback_list

    # -- for BackupAndRestore ----------------------------------------------------------------------
    def _callbacks_in_fit(self) -> list[Callback]:
        return list(self._callbacks)

    def _fit_position(self) -> tuple[dict[str, Any], dict[str, Any] | None, list[Any]]:
        """Where fit is (epoch, batches done in it, batches consumed from a one-shot iterator),
        the random state of the epoch's start, and the epoch's running metrics."""
        return dict(self._position), self._epoch_rng, self._compiled().metrics.state_dict()

    def _resume_from(
        self,
        progress: dict[str, Any],
        rng: dict[str, Any],
        epoch_rng: dict[str, Any] | None,
        metrics: list[Any],
    ) -> None:
        """Called from ``on_train_begin``: fit continues at ``progress``."""
        if not self._in_fit:
            raise RuntimeError("a fit position can only be restored when fit() begins")
        self._resume = {
            "progress": progress,
            "rng": rng,
            "epoch_rng": epoch_rng,
            "metrics": metrics,
        }

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
        self._compiled()
        if self._in_fit:
            raise RuntimeError(
                "evaluate() was called during fit() (from a callback?): it would reset the "
                "epoch's metrics; pass validation_data to fit() instead"
            )
        data = DataAdapter(x, y, sample_weight, batch_size, False, steps, "evaluate")
        verbose = _resolve_verbose(verbose)
        callback_list = self._callback_list(callbacks, verbose, with_history=False)
        callback_list.set_params({"epochs": 1, "steps": data.steps_per_epoch, "verbose": verbose})
        logs = self._test_loop(data, callback_list)
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def _test_loop(self, data: DataAdapter, callback_list: CallbackList) -> dict[str, Any]:
        steps = self._compiled()
        was_training = self._in_fit
        steps.metrics.reset()
        self._pull()
        self._set_training(False)
        callback_list.on_test_begin()
        step = 0
        try:
            for group in self._executions(data.epoch()):
                callback_list.on_test_batch_begin(step)
                self._merge(self._local_strategy.run(steps.test, args=(group,)))
                step += len(group)
                callback_list.on_test_batch_end(step - 1, steps.metrics.batch_logs())
        finally:
            self._set_training(was_training)
        if step == 0:
            raise ValueError("evaluate(): the evaluation data yielded no batches")
        logs = self._logs()
        callback_list.on_test_end(logs)
        return logs

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
        data = DataAdapter(x, None, None, batch_size, False, steps, "predict")
        verbose = _resolve_verbose(verbose)
        callback_list = self._callback_list(callbacks, verbose, with_history=False)
        callback_list.set_params({"epochs": 1, "steps": data.steps_per_epoch, "verbose": verbose})
        outputs: list[Any] = []
        self._pull()
        was_training = bool(self.module.training)
        self._set_training(False)
        callback_list.on_predict_begin()
        try:
            step = 0
            for group in self._executions(data.epoch()):
                runner = self._steps if self._steps is not None else _predict_only(self._replicas)
                callback_list.on_predict_batch_begin(step)
                per_batch = self._local_strategy.run(runner.predict, args=(group,))
                for index in range(len(group)):
                    outputs.append(
                        map_structure(
                            lambda t: t.cpu(), self._local_strategy.gather(per_batch[index], 0)
                        )
                    )
                step += len(group)
                callback_list.on_predict_batch_end(step - 1, {})
        finally:
            self._set_training(was_training)
        if not outputs:
            raise ValueError("predict(): the data yielded no batches")
        callback_list.on_predict_end()
        return map_structure(lambda *parts: torch.cat(parts), *outputs)

    # -- saving ------------------------------------------------------------------------------------
    def training_state(self) -> dict[str, Any]:
        """Model, optimizer, schedule, step count and loss scale, as plain data. With a
        sharded optimizer state (``zero_stage``) across workers this gathers it: a collective,
        so call it on every worker at the same point (``save`` and ``BackupAndRestore`` do)."""
        steps = self._compiled()
        return {
            "model": self.module.state_dict(),
            "optimizer": self._optimizer.state_dict(),
            "lr_scheduler": None if steps.lr_scheduler is None else steps.lr_scheduler.state_dict(),
            "iterations": self._iterations,
            "loss_scale": {
                "scale": self._loss_scale.scale,
                "good_steps": self._loss_scale.good_steps,
            },
        }

    def load_training_state(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        """Restore what ``training_state`` returned; all or nothing: every part is checked
        against this model first (``mirrored.training.saved_state``)."""
        steps = self._compiled()
        checked = saved_state.check_training_state(
            state, self._replicas, self._compiled_optimizer(), steps.lr_scheduler, source
        )
        self._optimizer.load_state_dict(checked.optimizer)
        self._replicas.load_state_dict(checked.model)
        if steps.lr_scheduler is not None and checked.lr_scheduler is not None:
            steps.lr_scheduler.load_state_dict(checked.lr_scheduler)
        self._iterations = checked.iterations
        self._loss_scale = checked.loss_scale

    def save(self, filepath: str | Path, allow_non_finite: bool = False) -> None:
        """Write the whole training state (``load`` restores it), atomically; only where the
        strategy writes checkpoints (the chief). Weights holding a NaN or an infinity are
        refused (a ValueError naming the entry; the file on disk stays) unless
        ``allow_non_finite``. On a ``ParameterServerStrategy`` the file is the coordinator's
        checkpoint of this model on the ps tasks (``ClusterCoordinator.save`` of it alone)."""
        if not allow_non_finite:
            self._refuse_non_finite(self.state_dict(), filepath)
        if self._on_parameter_servers:
            steps = self._compiled()
            scheduler = steps.lr_scheduler
            self._parameter_server_coordinator().save(
                filepath,
                {
                    "iterations": self._iterations,
                    "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
                },
                [self._mirrored_module()],
            )
            return
        # Every worker gathers the state (the optimizer's may be sharded: zero_stage); the chief
        # writes it.
        state = {"format": _MODEL_FORMAT, **self.training_state()}
        self.strategy.save_on_chief(lambda: checkpoint.save(state, filepath))

    def load(self, filepath: str | Path) -> None:
        """Restore a file written by ``save`` into this compiled model."""
        if self._on_parameter_servers:
            steps = self._compiled()
            metadata = self._parameter_server_coordinator().restore(
                filepath, [self._mirrored_module()]
            )
            self._iterations = int(metadata.get("iterations", 0))
            if steps.lr_scheduler is not None and metadata.get("lr_scheduler") is not None:
                steps.lr_scheduler.load_state_dict(metadata["lr_scheduler"])
            self._pull()
            return
        saved = checkpoint.load(filepath)
        if not isinstance(saved, dict) or saved.get("format") != _MODEL_FORMAT:
            raise ValueError(
                f"{str(filepath)!r} was not written by Model.save(); for weights only use "
                "load_weights()"
            )
        self.load_training_state(saved, repr(str(filepath)))
        self.strategy.check_same_on_workers(self.module.state_dict(), f"{str(filepath)!r}")

    def save_weights(self, filepath: str | Path, allow_non_finite: bool = False) -> None:
        """Write the module's state dict (a plain ``torch.load``-able file), atomically; only
        where the strategy writes checkpoints (the chief). Weights holding a NaN or an infinity
        are refused as by ``save``, unless ``allow_non_finite``."""
        weights = self.state_dict()
        if not allow_non_finite:
            self._refuse_non_finite(weights, filepath)
        self.strategy.save_on_chief(lambda: checkpoint.save(weights, filepath))

    @staticmethod
    def _refuse_non_finite(weights: dict[str, Any], filepath: str | Path) -> None:
        """Raise on every worker alike (their weights are the same), before any collective."""
        entry = state_checks.first_non_finite(weights)
        if entry is not None:
            raise ValueError(
                f"not writing {str(filepath)!r}: the weights are not finite ({entry!r} holds a "
                "NaN or an infinity), and a checkpoint is never written from such weights (the "
                "file already there stays); pass allow_non_finite=True to write them anyway"
            )

    def load_weights(self, filepath: str | Path) -> None:
        """Load weights from ``save_weights`` or ``save`` files (a parameter-server job's too)
        into every replica; a file that does not fit the model raises and loads nothing."""
        saved = checkpoint.load(filepath)
        if isinstance(saved, dict) and saved.get("format") == _MODEL_FORMAT:
            saved = saved["model"]
        elif isinstance(saved, dict) and saved.get("format") == parameter_server_checkpoint.FORMAT:
            if len(saved["models"]) != 1:
                raise ValueError(
                    f"{str(filepath)!r} holds {len(saved['models'])} models (a whole "
                    "ClusterCoordinator.save): restore it with ClusterCoordinator.restore, or "
                    "write this model alone with Model.save"
                )
            saved = saved["models"][0]["model"]
        if self._on_parameter_servers:
            self._parameter_server_coordinator().load_weights(self._mirrored_module(), saved)
            self._pull()
            return
        checkpoint.load_module_state(self._mirrored_module(), saved, repr(str(filepath)))
        self.strategy.check_same_on_workers(self.module.state_dict(), f"{str(filepath)!r}")

    # -- summary -----------------------------------------------------------------------------------
    def summary(self, print_fn: Callable[[str], Any] | None = print) -> str:
        """A table of the module's top-level layers and parameter counts; printed and returned."""
        rows = [("Layer (type)", "Param #")]
        for name, child in self.module.named_children():
            count = sum(p.numel() for p in child.parameters())
            rows.append((f"{name} ({type(child).__name__})", f"{count:,}"))
        total = sum(p.numel() for p in self.module.parameters())
        trainable = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        size = sum(p.numel() * p.element_size() for p in self.module.parameters())
        width = max(len(r[0]) for r in rows) + 4
        rule = "=" * (width + 14)
        lines = [f'Model: "{type(self.module).__name__}" on {self.strategy}', rule]
        lines += [f"{left:<{width}}{right:>14}" for left, right in rows[:1]]
        lines += [rule]
        lines += [f"{left:<{width}}{right:>14}" for left, right in rows[1:]]
        lines += [
            rule,
            f"Total params: {total:,} ({size / 2**20:.2f} MiB)",
            f"Trainable params: {trainable:,}",
            f"Non-trainable params: {total - trainable:,}",
        ]
        text = "\n".join(lines)
        if print_fn is not None:
            print_fn(text)
        return text


def _predict_only(replicas: Any) -> Steps:
    """The predict step of a model that was never compiled."""
    return Steps(
        module=replicas,
        optimizer=None,
        loss=None,
        metrics=MetricSet([], []),
        precision="32",
        schedule=None,
        lr_scheduler=None,
    )
