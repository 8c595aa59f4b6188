"""PowerSGD: each gradient matrix crosses the network as two thin rank-r factors.

``CommunicationOptions(compression=PowerSGD(rank=r))`` (Vogels, Karimireddy and Jaggi, 2019).
Each gradient of two or more dimensions is seen as a matrix M (its first dimension by the rest)
of n x m numbers. Instead of M, the workers sum P = M Q (n x r) and then Q' = M^T P^ (m x r),
where P^ is the orthonormalised sum of P and Q is the previous step's summed Q' (the same on
every worker: a warm start, so one step of power iteration per step tracks the gradient's
leading subspace). The update uses P^ Q'^T, the projection of the summed gradient onto that
subspace: r (n + m) numbers on the wire instead of n m.

What the projection leaves out is not lost: each worker keeps it (its own gradient minus its
share, 1/N, of the projection: the errors of the workers add up to exactly the part of the sum
that was not sent) and adds it to its next gradient ("error feedback"), so every gradient is
applied in full over time. Vectors (biases, norms), the per-parameter replica counts, and
matrices too small to gain (r (n + m) >= n m) are summed whole in the same collective as P.
Not the single-device run: compressed training converges (tested on the digits), it does not
reproduce one device's parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mirrored.comm.worker_group import PendingCollective, WorkerGroup

__all__ = ["PowerSGD", "PowerSGDBucket", "PowerSGDSum"]


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """Low-rank gradient compression between workers (a ``CommunicationOptions`` choice).

    Args:
        rank: the number of columns of the factors P and Q; higher sends more and
            approximates better.
    """

    rank: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGD(rank={self.rank!r}): expected a whole number >= 1")


@dataclasses.dataclass
class _Matrix:
    """One compressed gradient of a bucket, and what persists between steps."""

    offset: int
    rows: int
    cols: int
    rank: int
    q: torch.Tensor | None = None  # the summed Q' of the previous step (m x r)
    error: torch.Tensor | None = None  # what this worker has not sent yet (n x m)

    def view(self, bucket: torch.Tensor) -> torch.Tensor:
        return bucket[self.offset : self.offset + self.rows * self.cols].view(self.rows, self.cols)


class PowerSGDBucket:
    """The compression plan of one gradient bucket: which of its tensors go as factors.

    Args:
        options: the rank.
        layout: each tensor of the bucket as (offset, shape), in bucket order.
        numel: the bucket's length; whatever follows the tensors (the replica counts) is summed
            whole.
        seed: where this bucket's first Q comes from (the same on every worker).
    """

    def __init__(
        self,
        options: PowerSGD,
        layout: Sequence[tuple[int, torch.Size]],
        numel: int,
        seed: int,
    ) -> None:
        self._seed = seed
        self.matrices: list[_Matrix] = []
        whole: list[tuple[int, int]] = []
        end = 0
        for offset, shape in layout:
            size = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else 0
            cols = size // rows if rows else 0
            rank = min(options.rank, rows, cols)
            if rows and rank * (rows + cols) < rows * cols:
                self.matrices.append(_Matrix(offset, rows, cols, rank))
                whole.append((end, offset))
                end = offset + size
        whole.append((end, numel))
        self.whole = [(lo, hi) for lo, hi in whole if hi > lo]

    @property
    def compressed(self) -> bool:
        """Whether any tensor of the bucket travels as factors."""
        return bool(self.matrices)

    def first_q(self, matrix: _Matrix, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A random start for Q, the same on every worker."""
        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + matrix.offset)
        return torch.randn(matrix.cols, matrix.rank, generator=generator).to(device, dtype)


class PowerSGDSum:
    """One bucket's compressed sum over every worker, in flight: P and the whole parts are
    being summed (started at construction); ``wait()`` orthonormalises P, sums Q' and writes
    the approximation into the bucket in place."""

    def __init__(
        self, group: WorkerGroup, tensor: torch.Tensor, plan: PowerSGDBucket, label: str
    ) -> None:
        self._group = group
        self._tensor = tensor
        self._plan = plan
        self._label = label
        self._gradients: list[torch.Tensor] = []
        parts = [tensor[lo:hi] for lo, hi in plan.whole]
        for matrix in plan.matrices:
            gradient = matrix.view(tensor)
            if matrix.error is not None:
                gradient = gradient + matrix.error  # what earlier steps did not send
            if matrix.q is None:
                matrix.q = plan.first_q(matrix, tensor.device, tensor.dtype)
            self._gradients.append(gradient)
            parts.append((gradient @ matrix.q).reshape(-1))
        self._first = torch.cat(parts)
        self._pending: PendingCollective | None = group.all_reduce_async(
            self._first, f"{label} (PowerSGD: P and whole tensors)"
        )

    def wait(self) -> None:
        """Finish the sum: raises the group's diagnosis if a worker is missing."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.wait()
        plan, tensor = self._plan, self._tensor
        start = 0
        for lo, hi in plan.whole:
            tensor[lo:hi].copy_(self._first[start : start + hi - lo])
            start += hi - lo
        bases = []
        for matrix in plan.matrices:
            p = self._first[start : start + matrix.rows * matrix.rank].view(matrix.rows, -1)
            start += matrix.rows * matrix.rank
            bases.append(torch.linalg.qr(p).Q)  # P^: orthonormal columns
        second = torch.cat(
            [(g.T @ p).reshape(-1) for g, p in zip(self._gradients, bases, strict=True)]
        )
        self._group.all_reduce(second, f"{self._label} (PowerSGD: Q)")
        start = 0
        share = 1.0 / self._group.world_size
        for matrix, gradient, p in zip(plan.matrices, self._gradients, bases, strict=True):
            q = second[start : start + matrix.cols * matrix.rank].view(matrix.cols, -1)
            start += matrix.cols * matrix.rank
            approximation = p @ q.T
            matrix.error = gradient - share * approximation
            matrix.q = q.clone()
            matrix.view(tensor).copy_(approximation)
