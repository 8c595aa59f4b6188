"""The evaluate and predict loops: the model's own batches, run in this process.

They are the same for every strategy: on a ``ParameterServerStrategy`` they run on the
coordinator's copy of the model (``TrainingLoop.local_strategy``), pulled from the ps tasks
first. Validation during fit is the evaluate loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from mirrored.callbacks.callback import CallbackList
from mirrored.core.values import PerReplica, ReduceOp, map_structure
from mirrored.training.loop import LocalBatches
from mirrored.training.metric_set import MetricSet
from mirrored.training.steps import Steps

__all__ = ["batch_logs", "merge", "predict_only", "run_evaluate", "run_predict"]


def merge(strategy: Any, metrics: MetricSet, state: Any) -> None:
    """Add the replicas' partial sums to the metrics, where they are (no host copy). One
    replica's sums are the total already: no reduce, which would copy them to the strategy's
    first device."""
    if strategy.num_replicas_in_sync > 1 or isinstance(state, PerReplica):
        state = strategy.reduce(ReduceOp.SUM, state, axis=None)
    metrics.merge(state)


def batch_logs(
    callbacks: CallbackList, hook: str, metrics: MetricSet, num_examples: int | None = None
) -> dict[str, Any]:
    """A batch's logs for ``hook``: the metrics' results only when a callback reads them."""
    logs: dict[str, Any] = metrics.results() if callbacks.reads_batch_logs(hook) else {}
    if num_examples is not None:
        logs["num_examples"] = num_examples
    return logs


def run_evaluate(
    steps: Steps,
    local: LocalBatches,
    batches: Iterator[Any],
    callback_list: CallbackList,
    was_training: bool,
) -> dict[str, Any]:
    """The loss and metrics over ``batches``; the module back in training mode after, if it
    was (a validation during fit)."""
    steps.metrics.reset()
    local.set_training(False)
    callback_list.on_test_begin()
    step = 0
    try:
        for group in local.executions(batches):
            callback_list.on_test_batch_begin(step)
            merge(local.strategy, steps.metrics, local.strategy.run(steps.test, args=(group,)))
            step += len(group)
            callback_list.on_test_batch_end(
                step - 1, batch_logs(callback_list, "on_test_batch_end", steps.metrics)
            )
    finally:
        local.set_training(was_training)
    if step == 0:
        raise ValueError("evaluate(): the evaluation data yielded no batches")
    logs = steps.metrics.results()
    callback_list.on_test_end(logs)
    return logs


def run_predict(
    runner: Callable[[], Steps],
    local: LocalBatches,
    batches: Iterator[Any],
    callback_list: CallbackList,
    was_training: bool,
) -> Any:
    """Every batch's outputs, concatenated in order along the batch dimension, on the CPU
    (``runner``: the compiled steps, or ``predict_only`` of the replicas for a model never
    compiled)."""
    outputs: list[Any] = []
    local.set_training(False)
    callback_list.on_predict_begin()
    batch_dim = 0
    try:
        step = 0
        for group in local.executions(batches):
            callback_list.on_predict_batch_begin(step)
            steps = runner()
            batch_dim = steps.input_options.batch_dim
            per_batch = local.strategy.run(steps.predict, args=(group,))
            for index in range(len(group)):
                gathered = local.strategy.gather(per_batch[index], batch_dim)
                outputs.append(map_structure(lambda t: t.cpu(), gathered))
            step += len(group)
            callback_list.on_predict_batch_end(step - 1, {})
    finally:
        local.set_training(was_training)
    if not outputs:
        raise ValueError("predict(): the data yielded no batches")
    callback_list.on_predict_end()
    return map_structure(lambda *parts: torch.cat(parts, batch_dim), *outputs)


def predict_only(replicas: Any) -> Steps:
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
