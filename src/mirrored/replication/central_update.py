"""A central-storage update: the optimizer's state and its update on one parameter device.

TensorFlow's ``CentralStorageStrategy`` keeps every variable on one parameter device and mirrors
only the compute: what fits a machine whose GPUs lack peer links, or whose GPU memory cannot hold
the optimizer state. Here the replicas' gradients are still summed during backward (so every
replica's ``.grad`` is the global batch's, to clip or read, as under ``MirroredStrategy``), and the
update runs once, on the parameter device: by the replica there when it is one of the compute
devices, else on a copy of the parameters that lives there with the only optimizer state (the
user's optimizer shows the same state tensors, so its ``state_dict()`` is the plain one). The new
values are then copied to every replica.

The copy takes replica 0's values and gradients before each update, so what a program changed on
the model outside ``strategy.run`` (which reaches every replica first) reaches the update too;
its hyperparameters are replica 0's as of the step (an LR schedule), as every replica's are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mirrored.core.param_groups import snapshot, take_hyperparameters
from mirrored.replication.optimizer_copies import replicate_optimizer
from mirrored.replication.sharded_update import load_own_copy

__all__ = ["CentralUpdate"]


class CentralUpdate:
    """One mirrored optimizer's update, applied on ``parameter_device`` and copied out.

    Args:
        optimizers: one per replica (replica 0's is the user's).
        params: each replica's parameters of those optimizers, in the same order.
        parameter_device: where the update runs and the optimizer state lives.
        owner: the replica whose device is the parameter device (its parameters and optimizer
            are the central ones), or None for a copy of the parameters on that device.
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[nn.Parameter]],
        parameter_device: torch.device,
        owner: int | None,
    ) -> None:
        self.parameter_device = parameter_device
        self._optimizers = list(optimizers)
        self._params = [list(p) for p in params]
        self._owner = owner
        # The replica whose thread applies the update: the owner, or replica 0 for a copy.
        self.updater = 0 if owner is None else owner
        if owner is None:
            self._central = [
                nn.Parameter(p.detach().to(parameter_device, copy=True), p.requires_grad)
                for p in self._params[0]
            ]
            mapping = {id(p): c for p, c in zip(self._params[0], self._central, strict=True)}
            self.optimizer = replicate_optimizer(optimizers[0], mapping)
        else:
            self._central = self._params[owner]
            self.optimizer = optimizers[owner]
        self._updated: list[int] = []  # positions the last update changed
        for optimizer in self._optimizers:  # the state lives once, in the central optimizer
            if optimizer is not self.optimizer:
                optimizer.state.clear()
        self._share_state()

    def step(self, replica_id: int) -> Any:
        """The whole step of a single replica: ``update``, then ``copy_out``."""
        result = self.update(replica_id)
        self.copy_out(replica_id)
        return result

    def update(self, replica_id: int) -> Any:
        """On the updating replica's thread: update the central parameters with the global
        batch's gradients, and wait for the device to finish (the other replicas copy the
        values next, on streams of their own); on the others, nothing. The caller makes every
        replica wait for it before any calls ``copy_out``."""
        if replica_id != self.updater:
            return None
        if self._owner is None:
            self._take_replica_values()
        result = self.optimizer.step()
        # Those with a gradient (the update left the others alone), noted before the updating
        # replica goes on to zero its gradients while the others copy.
        self._updated = [i for i, central in enumerate(self._central) if central.grad is not None]
        self._share_state()
        if self.parameter_device.type == "cuda":
            torch.cuda.current_stream(self.parameter_device).synchronize()
        return result

    def copy_out(self, replica_id: int) -> None:
        """The updated values into this replica's parameters, on its own thread and stream (so
        its next kernels are ordered after the copy)."""
        mine = self._params[replica_id]
        if mine is self._central:
            return
        with torch.no_grad():
            for index in self._updated:
                mine[index].copy_(self._central[index])

    def _share_state(self) -> None:
        """Show the central state in the user's optimizer (replica 0's) too, the same tensors
        keyed by its own parameters, so that its ``state`` and ``state_dict()`` are the plain
        single-device ones."""
        user = self._optimizers[0]
        if user is self.optimizer:
            return
        for param, central in zip(self._params[0], self._central, strict=True):
            if central in self.optimizer.state:
                user.state[param] = self.optimizer.state[central]

    def _take_replica_values(self) -> None:
        """Replica 0's parameters, gradients and hyperparameters into the central copy."""
        with torch.no_grad():
            for param, central in zip(self._params[0], self._central, strict=True):
                central.copy_(param)
                if param.grad is None:
                    central.grad = None
                elif central.grad is None:
                    central.grad = param.grad.to(self.parameter_device, copy=True)
                else:
                    central.grad.copy_(param.grad)
        groups = snapshot(self._optimizers[0].param_groups)
        for group, values in zip(self.optimizer.param_groups, groups, strict=True):
            take_hyperparameters(group, values)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``state_dict`` into the central optimizer only (moved to the parameter device), once
        it is checked to fit; the user's optimizer shows it and takes its hyperparameters."""
        load_own_copy(self.optimizer, state_dict)
        user = self._optimizers[0]
        if user is not self.optimizer:
            user.state.clear()
            self._share_state()
            for group, values in zip(
                user.param_groups, snapshot(self.optimizer.param_groups), strict=True
            ):
                take_hyperparameters(group, values)
