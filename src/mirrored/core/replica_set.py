"""The replica-set contract: a strategy whose replicas this process runs, as its replicas see it.

What runs inside a replica (its ``ReplicaContext``, the mirrored module and optimizer, the
gradient reducers, synchronised batch norm) talks to the strategy through this and nothing else:
the devices, the collectives among the replicas of a run, the replica active on a device
(autograd hooks find their step there), a tracker of what is kept identical on every replica, and
what to release when the strategy closes.
:class:`mirrored.strategies.in_process.InProcessStrategy` implements it; declaring it here, below
the strategies, keeps the layers honest with type hints counted.

A collective takes the calling replica as a ``Participant``: anything holding its
``ReplicaExchange`` with its peers (a ``ReplicaContext`` is one).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from mirrored.core.strategy import Strategy
from mirrored.core.values import ReduceOp

if TYPE_CHECKING:
    from mirrored.config import LogicalDevice
    from mirrored.core.replica_meeting import ReplicaExchange

__all__ = ["Participant", "ReplicaSet", "Replicated"]


class Participant(Protocol):
    """A replica inside a run, as a collective sees it."""

    @property
    def exchange(self) -> ReplicaExchange: ...


class Replicated(Protocol):
    """Something kept identical on every replica (a mirrored module or optimizer)."""

    def resync(self) -> None: ...


class ReplicaSet(Strategy):
    """A strategy whose replicas run in this process, one per device."""

    devices: tuple[LogicalDevice, ...]  # the replicas' logical devices, in replica order

    @property
    @abc.abstractmethod
    def torch_devices(self) -> tuple[torch.device, ...]:
        """The replicas' torch devices, in replica order."""

    @abc.abstractmethod
    def all_reduce_tensors(
        self, replica: Participant, reduce_op: ReduceOp, tensors: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Collective: reduce a list of tensors across replicas, packed into buckets. Every
        replica must pass the same shapes and dtypes (a ValueError naming them otherwise)."""

    @abc.abstractmethod
    def all_gather_tensors(
        self, replica: Participant, tensors: Sequence[torch.Tensor], axis: int
    ) -> list[torch.Tensor]:
        """Collective: each tensor concatenated along ``axis`` over the replicas, in replica
        order, on this replica's device (sizes along ``axis`` may differ)."""

    @abc.abstractmethod
    def active_replica(self, local_replica_id: int) -> Participant | None:
        """A local replica inside the current run (None outside one): autograd hooks, which may
        run on autograd's device threads, find their step's exchange here."""

    @abc.abstractmethod
    def track_replicated(self, replicated: Replicated) -> None:
        """Keep ``replicated`` identical on every replica: resync it from replica 0 whenever a
        run fails, and carry what the program changes on replica 0 between runs."""

    @abc.abstractmethod
    def untrack_replicated(self, replicated: Replicated) -> None:
        """Stop tracking ``replicated`` (a released mirror)."""

    @abc.abstractmethod
    def at_close(self, release: Callable[[], None]) -> None:
        """Call ``release`` (a bound method, held weakly: a holder collected first has
        released already) when this strategy closes: what only its replicas needed, such as a
        mirrored optimizer's patches of torch."""
