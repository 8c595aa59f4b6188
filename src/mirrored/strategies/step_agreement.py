"""Whether every worker's input yields the same global batches, checked as the workers read it.

Workers that read different data (another file, another shuffle, a shorter shard) would train
apart or wait on each other's collectives until the timeout; the distributed datasets of
:mod:`mirrored.input` ask this agreement at each iteration and step, and it names what differs.
"""

from __future__ import annotations

from collections import deque

import torch

from mirrored.comm.gather_by_sum import Pending
from mirrored.comm.worker_group import WorkerGroup

__all__ = ["WorkerStepAgreement"]


class WorkerStepAgreement:
    """The ``StepAgreement`` (:mod:`mirrored.input`) of a multi-worker strategy's input: checks
    that every worker's input yields the same global batches: the same number of steps, and the
    same examples in each iteration's first batch (workers seeded differently would shuffle
    differently, and examples would be dropped or seen twice without an error).

    A dataset of known length (a list, a DataLoader over a map-style dataset) is checked once
    per iteration: the workers compare lengths. Otherwise, for a global dataset (every worker
    sees the whole batch) the check of step ``k`` runs in the background and is read at step
    ``k+1``, so it costs no wait; per-worker pipelines must agree on the global batch size before
    each step, so there the check waits.
    """

    def __init__(self, group: WorkerGroup, wait_for_global_size: bool) -> None:
        self._group = group
        self._wait = wait_for_global_size
        self._pending: deque[tuple[list[torch.Tensor], Pending]] = deque()
        self._steps = 0
        self._per_step = True
        group.add_explainer(self._explain)

    def begin(self, num_steps: int | None, first_batch: int | None = None) -> None:
        self._per_step = num_steps is None or self._wait
        if self._per_step and first_batch is None:
            return
        mine = torch.tensor(
            [-1 if self._per_step else num_steps, -1 if first_batch is None else first_batch],
            device=self._group.meta_device,
        )
        gathered = self._group.all_gather(mine, "input: dataset lengths and first batches")
        lengths = [int(p[0].item()) for p in gathered]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"the workers' datasets have different lengths ({lengths}, by rank): every "
                "worker must iterate the same global batches (the same dataset in every worker)"
            )
        if len({int(p[1].item()) for p in gathered}) > 1:
            raise ValueError(
                "the workers' first global batches hold different examples: their DataLoaders "
                "shuffle differently. Every worker must iterate the same global batches: seed "
                "every worker alike (torch.manual_seed(seed) before iterating), or give the "
                "DataLoader generator=torch.Generator().manual_seed(seed)"
            )

    def batch(self, num_examples: int) -> int:
        if not self._per_step:
            return num_examples
        self._start(num_examples, has_batch=True)
        if self._wait:
            return sum(int(p[1].item()) for p in self._settle())
        self._check_all_but_last()
        return num_examples

    def end(self) -> None:
        if not self._per_step:
            return
        self._start(0, has_batch=False)
        self._settle()

    def _start(self, num_examples: int, has_batch: bool) -> None:
        self._steps += has_batch
        mine = torch.tensor(
            [int(has_batch), num_examples], dtype=torch.int64, device=self._group.meta_device
        )
        self._pending.append(self._group.all_gather_async(mine, "input: next batch"))

    def _check_all_but_last(self) -> None:
        while len(self._pending) > 1:
            parts, pending = self._pending.popleft()
            pending.wait()
            self._raise_if_uneven(parts)

    def _settle(self) -> list[torch.Tensor]:
        parts: list[torch.Tensor] = []
        while self._pending:
            parts, pending = self._pending.popleft()
            pending.wait()
            self._raise_if_uneven(parts)
        return parts

    def _raise_if_uneven(self, parts: list[torch.Tensor]) -> None:
        message = self._uneven(parts)
        if message:
            raise ValueError(message)

    def _uneven(self, parts: list[torch.Tensor]) -> str | None:
        has = [int(p[0].item()) for p in parts]
        if len(set(has)) == 1:
            return None
        done = [rank for rank, h in enumerate(has) if not h]
        more = [rank for rank, h in enumerate(has) if h]
        return (
            f"the input of worker(s) {done} ran out while worker(s) {more} still had batches "
            f"(at step {self._steps}): every worker's dataset must yield the same number of "
            "steps (shard the data evenly, or repeat it and set steps_per_epoch)"
        )

    def _explain(self) -> str | None:
        """For a failed collective: whether a finished check shows uneven input."""
        for parts, pending in self._pending:
            if pending.succeeded():
                message = self._uneven(parts)
                if message:
                    return message
        return None
