"""Mirroring a PyTorch module and its optimizers: one replica per device, kept identical.

``strategy.mirror(model, optimizer)`` builds the replicas here and returns proxies: a
:class:`~mirrored.replication.mirrored_module.MirroredModule` (inside ``strategy.run`` it resolves
to the current replica; outside, to replica 0, the user's original module moved to the first device)
and a :class:`~mirrored.replication.mirrored_optimizer.MirroredOptimizer`, whose ``step()`` inside a
replica is the merge point of a step: the gradients of all replicas are summed and every replica
ends the step with the same parameters. A run that fails midway resyncs every replica from replica
0, so they never diverge. ``strategy.mirror(model, opt_a, opt_b)`` mirrors several optimizers over
disjoint parts of one module (a GAN's two nets in one module, an encoder and a decoder at their own
learning rates): each sums the gradients of its own part at its ``step()``.

The pieces: :mod:`mirrored.replication.mirror_checks` (what is refused before mirroring),
:mod:`mirrored.replication.mirrored_module`, :mod:`mirrored.replication.mirrored_optimizer` (on
:mod:`mirrored.replication.replica_optimizers`, its ``torch.optim.Optimizer`` face, and
:mod:`mirrored.replication.update_plan`, how its updates run); torch's clipping, schedulers and
scalers inside replicas are :mod:`mirrored.torch_patches`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mirrored.replication.batch_norm import convert_sync_batch_norm, running_stat_buffers
from mirrored.replication.mirror_checks import (
    check_mirrorable,
    check_optimizer_params,
    check_optimizers,
)
from mirrored.replication.mirror_features import NO_FEATURES, MirrorFeatures
from mirrored.replication.mirrored_module import MIRRORED_BY, MirroredModule, tensors_of
from mirrored.replication.mirrored_optimizer import MirroredOptimizer
from mirrored.replication.optimizer_copies import replicate_optimizer

if TYPE_CHECKING:
    from mirrored.core.replica_set import ReplicaSet

__all__ = [
    "MirroredModule",
    "MirroredOptimizer",
    "check_optimizer_params",
    "mirror_module",
    "parameter_shares",
    "tensors_of",
]


def mirror_module(
    strategy: ReplicaSet,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    sync_batch_norm: bool,
    features: MirrorFeatures = NO_FEATURES,
) -> Any:
    """Build the replicas of ``module`` (and of each of ``optimizers``, over disjoint parts of
    it) on ``strategy``'s devices; the optimizers' updates have ``features`` (accumulation, local
    SGD, ZeRO...). Returns the mirrored module, or it and the mirrored optimizers in order."""
    check_mirrorable(module, optimizers)
    check_optimizers(module, optimizers)
    params = list(module.parameters())
    shares = parameter_shares(params, optimizers)
    if sync_batch_norm:
        module = convert_sync_batch_norm(module, strategy)
    devices = strategy.torch_devices
    first = module.to(devices[0])
    replicas = [first] + [copy.deepcopy(first).to(d) for d in devices[1:]]
    mirrored = MirroredModule(strategy, replicas, features)
    strategy.track_replicated(mirrored)
    MIRRORED_BY.register(mirrored)
    replica_params = [list(r.parameters()) for r in replicas]
    if not optimizers:
        # Updated by hand (p.data.add_(p.grad)): its gradients are still the global batch's
        # after loss.backward(), summed while backward runs.
        mirrored.keep_reducer(features.gradient_reducer(replica_params, None, None))
        return mirrored
    # BatchNorm's running statistics are averaged at the first optimizer's step (as with one);
    # the end of the run averages any that a later forward changed (buffer_sync.py).
    running = [
        [running_stat_buffers(r) if k == 0 else [] for r in replicas] for k in range(len(shares))
    ]
    mirrored_optimizers = []
    for optimizer, share, stats in zip(optimizers, shares, running, strict=True):
        copies = [optimizer] + [
            replicate_optimizer(optimizer, {id(p): q for p, q in zip(params, rp, strict=True)})
            for rp in replica_params[1:]
        ]
        own = [[rp[i] for i in share] for rp in replica_params]
        mirrored_optimizer = MirroredOptimizer(
            strategy, copies, own, stats, features, mirrored.buffer_sync
        )
        strategy.track_replicated(mirrored_optimizer)
        mirrored._optimizers.add(mirrored_optimizer)
        mirrored.keep_reducer(mirrored_optimizer.update_plan.reducer)
        mirrored_optimizers.append(mirrored_optimizer)
    return (mirrored, *mirrored_optimizers)


def parameter_shares(
    params: Sequence[nn.Parameter], optimizers: Sequence[torch.optim.Optimizer]
) -> list[list[int]]:
    """The positions in ``params`` (a module's) whose gradients each optimizer's mirror sums at
    its step: those it holds, and for the first also those no optimizer holds (as one
    optimizer sums every gradient of the module: clipping over ``model.parameters()`` reads
    them all)."""
    if not optimizers:
        return []
    holder = {
        id(p): position
        for position, optimizer in enumerate(optimizers)
        for group in optimizer.param_groups
        for p in group["params"]
    }
    shares: list[list[int]] = [[] for _ in optimizers]
    for index, param in enumerate(params):
        shares[holder.get(id(param), 0)].append(index)
    return shares
