"""Distributing input: the contexts and options of TensorFlow's input API, and the public names.

``InputContext`` tells an input function which part of the data to produce, ``InputOptions``
(:mod:`mirrored.input.options`) how a distributed dataset is read, ``ValueContext`` which replica
a value is for. How batches become per-replica shards lives in :mod:`mirrored.input.batch_split`,
the distributed datasets in :mod:`mirrored.input.distributed_dataset` and
:mod:`mirrored.input.loader_parts`; this module gathers them.
"""

from __future__ import annotations

import dataclasses

from mirrored.input.batch_split import (
    PerReplicaShards,
    batch_size_of,
    global_batch_size_of,
    shard_sizes,
    split_batch,
    stack_replica_batches,
)
from mirrored.input.distributed_dataset import (
    DistributedDataset,
    StepAgreement,
    distribute_global_batches,
    distribute_replica_batches,
)
from mirrored.input.loader_parts import (
    distribute_loader_parts,
    refuse_distributed_sampler,
    shardable_loader,
)
from mirrored.input.options import InputOptions, input_settings

__all__ = [
    "DistributedDataset",
    "InputContext",
    "InputOptions",
    "PerReplicaShards",
    "StepAgreement",
    "ValueContext",
    "batch_size_of",
    "distribute_global_batches",
    "distribute_loader_parts",
    "distribute_replica_batches",
    "global_batch_size_of",
    "input_settings",
    "refuse_distributed_sampler",
    "shard_sizes",
    "shardable_loader",
    "split_batch",
    "stack_replica_batches",
]


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What an input pipeline needs to know to produce its part of the data (TensorFlow's)."""

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch each replica gets; ``global_batch_size`` must divide evenly."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"num_replicas_in_sync={self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """Passed to ``experimental_distribute_values_from_function``'s function."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1
