"""A central-storage update: the optimizer's state and its update on one parameter device.

TensorFlow's ``CentralStorageStrategy`` keeps every variable on one parameter device and mirrors
only the compute: what fits a machine whose GPUs lack peer links, or whose GPU memory cannot hold
the optimizer state. Here the replicas' gradients are still summed during backward (so every
replica's ``.grad`` is the global batch's, to clip or read, as under ``MirroredStrategy``), and the
update runs once, on the parameter device: by the replica there when it is one of the compute
devices, else on a copy of the optimizer's parameters that lives there with the only optimizer
state. The program's optimizer shows the same state tensors (its ``state_dict()`` is the plain
one), and its step hooks and LR schedulers see the central step as its own. The updated values
are then copied into every replica, each replica on its own thread and stream.

The copy takes replica 0's values and gradients before each update, so what a program changed on
the model outside ``strategy.run`` (which reaches every replica first) reaches the update too;
its hyperparameters are replica 0's as of the step (an LR schedule), as every replica's are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mirrored._torch_internals import mark_step_called, share_step_hooks
from mirrored.core.param_groups import snapshot, take_group_hyperparameters
from mirrored.replication.optimizer_copies import replicate_optimizer
from mirrored.replication.sharded_update import load_own_copy

__all__ = ["CentralUpdate"]


class CentralUpdate:
    """One mirrored optimizer's update, applied on ``parameter_device`` and copied out.

    Args:
        optimizers: one per replica (replica 0's is the program's).
        params: each replica's parameters of those optimizers, in the same order (the first
            optimizer's share also holds the module's parameters no optimizer holds, which the
            update leaves alone).
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
        held = {id(p) for group in optimizers[0].param_groups for p in group["params"]}
        self._held = [i for i, p in enumerate(self._params[0]) if id(p) in held]
        if owner is None:
            originals = [self._params[0][i] for i in self._held]
            self._central = [
                nn.Parameter(p.detach().to(parameter_device, copy=True), p.requires_grad)
                for p in originals
            ]
            mapping = {id(p): c for p, c in zip(originals, self._central, strict=True)}
            self.optimizer = replicate_optimizer(optimizers[0], mapping)
        else:
            self._central = [self._params[owner][i] for i in self._held]
            self.optimizer = optimizers[owner]
        self._updated: list[int] = []  # positions in _held the last update changed
        for optimizer in self._optimizers:  # the state lives once, in the central optimizer
            if optimizer is not self.optimizer:
                optimizer.state.clear()
        if self.optimizer is not optimizers[0]:
            share_step_hooks(optimizers[0], self.optimizer)
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
        self._updated = [k for k, central in enumerate(self._central) if central.grad is not None]
        self._share_state()
        if self.optimizer is not self._optimizers[0]:
            mark_step_called(self._optimizers[0])  # for its LR scheduler: it stepped
        _wait_for(self.parameter_device)
        return result

    def copy_out(self, replica_id: int) -> None:
        """The updated values into this replica's parameters, on its own thread and stream,
        finished before it returns: the caller makes every replica wait for the others' copies
        before the central values may change again (the owner's replica function goes on)."""
        if replica_id == self._owner:
            return
        mine = self._params[replica_id]
        with torch.no_grad():
            for k in self._updated:
                mine[self._held[k]].copy_(self._central[k])
        if self._updated:
            _wait_for(mine[self._held[0]].device)

    def _take_replica_values(self) -> None:
        """Replica 0's parameters, gradients and hyperparameters into the central copy."""
        with torch.no_grad():
            for index, central in zip(self._held, self._central, strict=True):
                param = self._params[0][index]
                central.copy_(param)
                if param.grad is None:
                    central.grad = None
                elif central.grad is None:
                    central.grad = param.grad.to(self.parameter_device, copy=True)
                else:
                    central.grad.copy_(param.grad)
        groups = snapshot(self._optimizers[0].param_groups)
        take_group_hyperparameters(self.optimizer.param_groups, groups)

    def _share_state(self) -> None:
        """Show the central state in the program's optimizer (replica 0's) too, the same tensors
        keyed by its own parameters, so that its ``state`` and ``state_dict()`` are the plain
        single-device ones."""
        user = self._optimizers[0]
        if user is self.optimizer:
            return
        for index, central in zip(self._held, self._central, strict=True):
            if central in self.optimizer.state:
                user.state[self._params[0][index]] = self.optimizer.state[central]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``state_dict`` into the central optimizer only (moved to the parameter device), once
        it is checked to fit; the program's optimizer shows it and takes its hyperparameters."""
        load_own_copy(self.optimizer, state_dict)
        user = self._optimizers[0]
        if user is not self.optimizer:
            user.state.clear()
            self._share_state()
            take_group_hyperparameters(user.param_groups, snapshot(self.optimizer.param_groups))


def _wait_for(device: torch.device) -> None:
    """Wait until this thread's work on ``device`` is done (at once on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
