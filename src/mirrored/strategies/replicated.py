"""The replicated family: strategies that keep a whole copy of the model on every replica.

``MirroredStrategy`` and ``MultiWorkerMirroredStrategy`` mirror a module and its optimizer onto each
replica (:mod:`mirrored.replication.mirror`) and all-reduce the gradients. Their update features
live here, not on the ``Strategy`` contract, since only a mirrored optimizer of this family uses
them (the family is the ``MirrorFeatures`` its ``mirror`` hands over): gradient accumulation
(:mod:`mirrored.replication.accumulation`), local SGD (:mod:`mirrored.replication.local_sgd`) and
sharded optimizer state (:mod:`mirrored.replication.zero_redundancy`).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch

from mirrored.comm.cross_device_ops import CrossDeviceOps, HierarchicalCopyAllReduce
from mirrored.config import LogicalDevice
from mirrored.core import context
from mirrored.core.user_frames import user_stacklevel
from mirrored.replication.accumulation import AccumulationWindow, check_accumulation_steps
from mirrored.replication.global_batch_loss import check_loss_scaling
from mirrored.replication.local_sgd import LocalSGD, LocalSteps
from mirrored.replication.mirror_features import MirrorFeatures
from mirrored.replication.mirrored_module import MirroredModule
from mirrored.replication.zero_redundancy import ZeroRedundancy, check_zero_stage
from mirrored.strategies.in_process import InProcessStrategy

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from mirrored.replication.mirror import MirroredOptimizer

__all__ = ["ReplicatedStrategy", "observe_backward"]

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


class ReplicatedStrategy(InProcessStrategy, MirrorFeatures):
    """Base of the strategies that mirror a whole model onto every replica.

    Args (keyword-only, after the ``InProcessStrategy``'s):
        gradient_accumulation_steps: how many ``optimizer.step()`` calls of a mirrored
            optimizer make one update.
        local_sgd: periodic parameter averaging instead of a gradient all-reduce per update.
        zero_stage: sharded optimizer state (1) and gradients (2); 0 keeps all of it on every
            replica.
    """

    def __init__(
        self,
        devices: Sequence[LogicalDevice],
        cross_device_ops: CrossDeviceOps,
        timeout_seconds: float | None,
        *,
        gradient_accumulation_steps: int = 1,
        local_sgd: LocalSGD | None = None,
        zero_stage: int = 0,
    ) -> None:
        self.gradient_accumulation_steps = check_accumulation_steps(gradient_accumulation_steps)
        self.zero_stage = check_zero_stage(zero_stage)
        if local_sgd is not None and not isinstance(local_sgd, LocalSGD):
            raise TypeError(
                f"local_sgd={local_sgd!r}: expected mirrored.LocalSGD(period=..., warmup_steps=...)"
            )
        if local_sgd is not None and zero_stage:
            raise ValueError(
                f"local_sgd and zero_stage={zero_stage} do not combine: local SGD updates every "
                "replica with its own gradient, so each replica needs the whole optimizer state"
            )
        self.local_sgd = local_sgd
        super().__init__(devices, cross_device_ops, timeout_seconds)
        self._windows: weakref.WeakSet[AccumulationWindow] = weakref.WeakSet()

    # -- models -----------------------------------------------------------------------------------
    @overload
    def mirror(
        self, module: torch.nn.Module, optimizer: None = None, *, sync_batch_norm: bool = False
    ) -> MirroredModule: ...

    @overload
    def mirror(
        self, module: torch.nn.Module, optimizer: OptimizerT, *, sync_batch_norm: bool = False
    ) -> tuple[MirroredModule, MirroredOptimizer]: ...

    @overload
    def mirror(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        second_optimizer: torch.optim.Optimizer,
        /,
        *,
        sync_batch_norm: bool = False,
    ) -> tuple[MirroredModule, MirroredOptimizer, MirroredOptimizer]: ...

    @overload
    def mirror(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        second_optimizer: torch.optim.Optimizer,
        /,
        *more_optimizers: torch.optim.Optimizer,
        sync_batch_norm: bool = False,
    ) -> tuple[
        MirroredModule, MirroredOptimizer, MirroredOptimizer, Unpack[tuple[MirroredOptimizer, ...]]
    ]: ...

    @overload
    def mirror(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        sync_batch_norm: bool = False,
    ) -> MirroredModule | tuple[MirroredModule, MirroredOptimizer]: ...

    def mirror(
        self,
        module: torch.nn.Module,
        *optimizers: torch.optim.Optimizer | None,
        sync_batch_norm: bool = False,
        **keywords: Any,
    ) -> MirroredModule | tuple[MirroredModule | MirroredOptimizer, ...]:
        """One replica of ``module`` per device (the original becomes replica 0), and for each
        optimizer (several: over disjoint parts of the module, a GAN's or an encoder's and a
        decoder's) one whose ``step()`` inside ``strategy.run`` updates every replica alike
        (their gradients are summed during backward). Returns the mirrored module, or it and the
        mirrored optimizers in the order given. ``keywords`` only catches a misplaced optimizer,
        to say how to pass it. See :mod:`mirrored.replication.mirror`."""
        from mirrored.replication.mirror import mirror_module
        from mirrored.replication.mirror_checks import optimizers_given

        given = optimizers_given(optimizers, keywords)
        return mirror_module(self, module, given, sync_batch_norm=sync_batch_norm, features=self)

    def replica_modules(self, local_replica_id: int) -> list[torch.nn.Module]:
        """The replica ``local_replica_id`` of every module mirrored by this strategy (what a
        traced step, :func:`mirrored.function`, depends on)."""
        return [
            r.replicas[local_replica_id]
            for r in list(self._replicated)
            if isinstance(r, MirroredModule) and not r.released
        ]

    # -- the mirrored optimizer's features --------------------------------------------------------
    def accumulation_window(self) -> AccumulationWindow | None:
        """A new mirrored optimizer's window of micro-steps (None: it updates at every step)."""
        if self.gradient_accumulation_steps == 1:
            return None
        window = AccumulationWindow(self.gradient_accumulation_steps, len(self.devices))
        self._windows.add(window)
        return window

    def holding_gradients(self, local_replica_id: int) -> bool:
        """Whether a mirrored optimizer is inside an accumulation window on this replica: its
        gradients are the window's so far, and ``zero_grad()`` leaves them."""
        return any(window.holding(local_replica_id) for window in list(self._windows))

    def owner_updates(self) -> bool:
        """With the slice-parallel ``HierarchicalCopyAllReduce`` every replica holds the summed
        gradients in place: an owner can update each parameter for all."""
        return isinstance(self.cross_device_ops, HierarchicalCopyAllReduce)

    def local_steps(self) -> LocalSteps | None:
        """A new mirrored optimizer's local SGD schedule (None: every update is synchronous)."""
        if self.local_sgd is None:
            return None
        return LocalSteps(self.local_sgd, len(self.devices))

    def zero_redundancy(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[torch.nn.Parameter]],
    ) -> ZeroRedundancy | None:
        """A new mirrored optimizer's sharding of its state over the replicas (None: with
        ``zero_stage=0`` every replica keeps all of it)."""
        if self.zero_stage == 0:
            return None
        physical = {d.physical for d in self.devices}
        if self.zero_stage == 1 and self.communicator.workers is None and len(physical) == 1:
            replicas = f"{len(self.devices)} replica{'s' if len(self.devices) > 1 else ''}"
            warnings.warn(
                f"zero_stage=1 saves no memory on {replicas} sharing one device's memory "
                f"({next(iter(physical))}): they already keep one optimizer state, each "
                "parameter updated by its owner, so the peak is zero_stage=0's. zero_stage=2 "
                "lowers it there (the gradients are summed at optimizer.step(), with no "
                "reduction buckets); ZeRO-1 pays across GPUs or worker processes",
                stacklevel=user_stacklevel(),
            )
        return ZeroRedundancy(self.zero_stage, optimizers, params, self.communicator)


def observe_backward(roots: tuple[torch.Tensor, ...]) -> None:
    """As a replica starts a backward pass from ``roots``: count it (a mirrored optimizer checks
    at its step that every replica ran one), and refuse a loss averaged over the replica's shard
    (:mod:`mirrored.replication.global_batch_loss`)."""
    replica = context.current_replica_context()
    if replica is not None:
        check_loss_scaling(roots, replica)
        replica.backward_passes += 1
