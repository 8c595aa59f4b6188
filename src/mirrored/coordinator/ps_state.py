"""The mirrored models' state on the ps tasks, read and written as a whole: what the coordinator's
checkpoints (``ClusterCoordinator.save`` / ``restore`` / ``load_weights``) move.

Each call reaches every ps task at once; the caller makes sure no scheduled function runs
meanwhile. A ps task that does not answer raises ``PsTaskLostError``: its shards are gone, so the
job can only restart from its last checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed.rpc as rpc

from mirrored.parameter_server import checkpoint as parameter_server_checkpoint
from mirrored.parameter_server import shard_store
from mirrored.parameter_server.checkpoint import MirroredModel
from mirrored.strategies.parameter_server import ParameterServerStrategy

__all__ = ["PsTaskLostError", "mirrored_models", "read_entries", "split_entries", "write_entries"]


class PsTaskLostError(RuntimeError):
    """A ps task did not answer while its state was read or written."""


def mirrored_models(
    strategy: ParameterServerStrategy, handles: Sequence[Any] | None
) -> list[MirroredModel]:
    """The strategy's records of the models behind ``handles`` (None: every model)."""
    if handles is None:
        return list(strategy.models)
    by_id = {m.model_id: m for m in strategy.models}
    unknown = [h for h in handles if getattr(h, "model_id", None) not in by_id]
    if unknown:
        raise ValueError(
            f"{unknown[0]!r} was not mirrored by this coordinator's strategy: pass the "
            "handles strategy.mirror() returned"
        )
    return [by_id[h.model_id] for h in handles]


def read_entries(strategy: ParameterServerStrategy, models: list[MirroredModel]) -> list[Any]:
    """The checkpoint entries of ``models``, gathered from every ps task."""
    states = _on_every_ps(
        strategy,
        shard_store.state_dict,
        [[(m.model_id,) for m in models]] * strategy.num_ps,
    )
    return [
        parameter_server_checkpoint.gather(model, [task[i] for task in states])
        for i, model in enumerate(models)
    ]


def split_entries(
    strategy: ParameterServerStrategy, models: list[MirroredModel], entries: list[Any]
) -> list[list[Any]]:
    """Each model's entry cut into one part per ps task, every entry checked first: nothing is
    sent until all of them fit."""
    return [
        parameter_server_checkpoint.scatter(model, entry, strategy.num_ps)
        for model, entry in zip(models, entries, strict=True)
    ]


def write_entries(
    strategy: ParameterServerStrategy, models: list[MirroredModel], parts: list[list[Any]]
) -> None:
    """Load ``split_entries``' parts into the ps tasks."""
    _on_every_ps(
        strategy,
        shard_store.load_state_dict,
        [
            [(model.model_id, parts[i][ps]) for i, model in enumerate(models)]
            for ps in range(strategy.num_ps)
        ],
    )


def _on_every_ps(
    strategy: ParameterServerStrategy,
    function: Callable[..., Any],
    calls: list[list[tuple[Any, ...]]],
) -> list[list[Any]]:
    """``function(*args)`` for each of ``calls[i]`` on ps task i, all at once; the results in
    the same layout."""
    futures = [
        [rpc.rpc_async(ps, function, args, timeout=strategy.timeout_seconds) for args in task]
        for ps, task in zip(strategy.cluster.ps, calls, strict=True)
    ]
    try:
        return [[future.wait() for future in task] for task in futures]
    except Exception as error:
        raise PsTaskLostError(
            f"a ps task was lost during {function.__name__} ({error}); restart the job "
            "from its last checkpoint"
        ) from error
