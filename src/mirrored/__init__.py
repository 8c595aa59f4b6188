"""mirrored: TensorFlow's distribution strategies for PyTorch.

Write a single-device training step, or compile a ``mirrored.Model`` and call ``fit``;
``MirroredStrategy`` runs it on every local device with the single-device result on the global
batch.
"""

from __future__ import annotations

import importlib
from typing import Any

from mirrored import callbacks, checkpoint, config, losses, metrics, optimizers, partitioners
from mirrored._torch_internals import warn_if_untested_torch as _warn_if_untested_torch
from mirrored.checkpoint_manager import Checkpoint, CheckpointManager, latest_checkpoint
from mirrored.cluster.resolvers import (
    ClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
)
from mirrored.comm.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from mirrored.comm.formed_group import ProcessGroupClusterResolver
from mirrored.comm.powersgd import PowerSGD
from mirrored.core.context import (
    ReplicaContext,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from mirrored.core.replica_meeting import ReplicaAbortedError, SyncMismatchError, SyncTimeoutError
from mirrored.core.strategy import Strategy
from mirrored.core.values import PerReplica, ReduceOp, VariableAggregation
from mirrored.input import DistributedDataset, InputContext, InputOptions, ValueContext
from mirrored.input.load_balancing import LoadBalancing
from mirrored.pipeline.split import balance_by_time
from mirrored.preemption import Preempted, PreemptionWatcher
from mirrored.random.activation_checkpoint import activation_checkpoint_contexts
from mirrored.replication.buffer_sync import BufferAggregationWarning, set_buffer_aggregation
from mirrored.replication.global_batch_loss import (
    LossScalingWarning,
    compute_average_loss,
    compute_weighted_average_loss,
    scale_regularization_loss,
    scale_shard_mean,
)
from mirrored.replication.local_sgd import LocalSGD
from mirrored.replication.mirrored_module import MirroredModule
from mirrored.replication.mirrored_optimizer import MirroredOptimizer
from mirrored.replication.outside_edits import ReplicasDifferError
from mirrored.strategies.central_storage import CentralStorageStrategy

# Imported for its effect: it names the strategy in effect outside any scope.
from mirrored.strategies.default import default_strategy as _default_strategy  # noqa: F401
from mirrored.strategies.mirrored import MirroredStrategy
from mirrored.strategies.multi_worker import (
    CommunicationImplementation,
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
)
from mirrored.strategies.one_device import OneDeviceStrategy
from mirrored.strategies.pipeline import PipelinedModule, PipelinedOptimizer, PipelineStrategy
from mirrored.tracing.function import function
from mirrored.training import Model

__version__ = "0.1.0"

_warn_if_untested_torch()  # one UserWarning on a torch release CI does not test

__all__ = [
    "BufferAggregationWarning",
    "CentralStorageStrategy",
    "Checkpoint",
    "CheckpointManager",
    "ClusterCoordinator",
    "ClusterResolver",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DistributedDataset",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "LoadBalancing",
    "LocalSGD",
    "LossScalingWarning",
    "Model",
    "MirroredModule",
    "MirroredOptimizer",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "PipelineStrategy",
    "PipelinedModule",
    "PipelinedOptimizer",
    "PowerSGD",
    "ProcessGroupClusterResolver",
    "Preempted",
    "PreemptionWatcher",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaAbortedError",
    "ReplicaContext",
    "ReplicasDifferError",
    "SlurmClusterResolver",
    "Strategy",
    "SyncMismatchError",
    "SyncTimeoutError",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "ValueContext",
    "VariableAggregation",
    "activation_checkpoint_contexts",
    "balance_by_time",
    "callbacks",
    "checkpoint",
    "compute_average_loss",
    "compute_weighted_average_loss",
    "config",
    "function",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "latest_checkpoint",
    "losses",
    "metrics",
    "optimizers",
    "partitioners",
    "scale_regularization_loss",
    "scale_shard_mean",
    "set_buffer_aggregation",
]

# Built on torch.distributed.rpc, which some builds of torch lack: imported when first used.
_ON_FIRST_USE = {
    "ClusterCoordinator": "mirrored.coordinator.cluster_coordinator",
    "ParameterServerStrategy": "mirrored.strategies.parameter_server",
}


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        return getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    raise AttributeError(f"module 'mirrored' has no attribute {name!r}")
