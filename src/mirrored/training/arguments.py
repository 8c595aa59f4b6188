"""The checks of what ``Model.compile`` and ``Model.fit`` are given, before anything changes.

Each function turns one user argument into what the model keeps, or raises a ValueError or
TypeError naming the argument, the value and the fix, so that a wrong call leaves the model as
it was.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from mirrored import losses as losses_module
from mirrored import metrics as metrics_module
from mirrored import optimizers as optimizers_module
from mirrored.core import context
from mirrored.input import InputOptions
from mirrored.input.options import checked_options
from mirrored.training.data_adapter import DataAdapter, _is_array_structure
from mirrored.training.metric_set import MetricSet
from mirrored.training.steps import PRECISIONS

__all__ = [
    "boolean",
    "build_optimizer",
    "check_can_compile",
    "check_lr_scheduler",
    "check_precision",
    "checked_input_options",
    "loss_and_metrics",
    "positive_int",
    "resolve_verbose",
    "validation_adapter",
    "validation_schedule",
]


def resolve_verbose(verbose: int | str) -> int:
    if verbose == "auto":
        return 1 if sys.stdout.isatty() else 2
    if verbose not in (0, 1, 2) or isinstance(verbose, bool):
        raise ValueError(f"verbose={verbose!r}: expected 'auto', 0, 1 or 2")
    return int(verbose)


def positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r}: expected a positive int")
    return value


# -- compile -------------------------------------------------------------------------------------
def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: expected True or False")
    return value


def check_can_compile(strategy: Any, fitting: bool) -> None:
    """A model created under ``strategy`` is compiled in its scope, and not while it fits."""
    current = context.get_strategy()
    if context.has_strategy() and current is not strategy:
        raise ValueError(
            f"compile() was called in the scope of {current}, but the model was created "
            f"under {strategy}; create and compile the model in the same scope"
        )
    if fitting:
        raise RuntimeError("compile() was called during fit(); compile before fit")


def checked_input_options(options: Any) -> InputOptions:
    """``compile``'s ``input_options`` (None: the defaults). Read-ahead is refused: fit keeps
    the count of batches it consumed for ``BackupAndRestore``, and array data draws its order
    from torch's generator as an epoch starts, both of which a reading thread would run ahead
    of the training."""
    checked = checked_options(options, "input_options")
    if checked.experimental_per_replica_buffer_size:
        raise ValueError(
            f"compile(input_options=InputOptions(experimental_per_replica_buffer_size="
            f"{checked.experimental_per_replica_buffer_size})): fit, evaluate and predict read "
            "each batch as they run it; read ahead in the data instead (a DataLoader with "
            "num_workers and prefetch_factor), or in a custom loop over "
            "experimental_distribute_dataset"
        )
    return checked


def _compiled_loss(loss: Any) -> losses_module.Loss | None:
    loss_object = None if loss is None else losses_module.get(loss)
    if getattr(loss_object, "ignore_class", None) is not None:
        raise ValueError(
            "compile() does not take a loss with ignore_class yet (fit averages over every "
            "position of the global batch); give the ignored positions sample_weight 0"
        )
    return loss_object


def check_precision(precision: str, strategy: Any) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {sorted(PRECISIONS)}")
    if precision == "16-mixed" and not strategy.gradients_after_backward:
        raise ValueError(
            f"precision='16-mixed' unscales gradients between backward and the optimizer "
            f"step, where {type(strategy).__name__} has not summed them yet; use "
            "precision='bf16-mixed' (no loss scaling) or '32'"
        )


def _compiled_metrics(argument: str, metrics: Any, loss: Any) -> list[metrics_module.Metric]:
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


def loss_and_metrics(
    loss: Any, metrics: Any, weighted_metrics: Any
) -> tuple[losses_module.Loss | None, MetricSet]:
    """``compile()``'s loss, and its metrics and weighted metrics as one set."""
    loss_object = _compiled_loss(loss)
    return loss_object, _metric_set(
        _compiled_metrics("metrics", metrics, loss_object),
        _compiled_metrics("weighted_metrics", weighted_metrics, loss_object),
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


def build_optimizer(
    optimizer: Any, module: torch.nn.Module
) -> tuple[torch.optim.Optimizer, optimizers_module.Optimizer | None]:
    """The torch optimizer on ``module``'s parameters, and the spec when its learning rate is
    a schedule."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, None
    spec = optimizers_module.get(optimizer)
    torch_optimizer = spec.build(module.parameters())
    return torch_optimizer, spec if spec.is_scheduled else None


def check_lr_scheduler(lr_scheduler: Any, optimizer: torch.optim.Optimizer, schedule: Any) -> None:
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


# -- fit -----------------------------------------------------------------------------------------
def validation_adapter(
    validation_data: Any, batch_size: int | None, batch_dim: int
) -> DataAdapter | None:
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
            validation_data[0],
            validation_data[1],
            weight,
            batch_size,
            purpose="evaluate",
            batch_dim=batch_dim,
        )
    return DataAdapter(validation_data, purpose="evaluate", batch_dim=batch_dim)


def validation_schedule(validation_freq: Any) -> Callable[[int], bool]:
    """Whether to validate after an epoch (0-based), from fit's ``validation_freq``."""
    if isinstance(validation_freq, int) and not isinstance(validation_freq, bool):
        frequency = positive_int("validation_freq", validation_freq)
        return lambda epoch: (epoch + 1) % frequency == 0
    if isinstance(validation_freq, (list, tuple, set, range)):
        epochs = set(validation_freq)
        return lambda epoch: epoch + 1 in epochs
    raise ValueError(
        f"validation_freq={validation_freq!r}: expected a positive int (every N epochs) or "
        "a collection of 1-based epochs"
    )
