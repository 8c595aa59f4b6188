"""Each step's seed: the number the caller's global generator draws next, drawn once, and only
if a replica needs randomness.

Replicas draw from generators of their own, seeded each step from this one seed
(:mod:`mirrored.random.routing`). Taking the seed from the caller's generator makes a run
reproducible from ``torch.manual_seed``; taking it only when a replica draws leaves a step
without random ops, and the caller's random stream (a shuffling DataLoader's), as in a plain
loop.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from mirrored._torch_internals import outside_functorch
from mirrored._torch_tracing import outside_dispatch_modes

__all__ = ["StepSeed", "global_generators_lock"]

# Held while torch's process-wide generators are read or swapped: every thread shares them.
global_generators_lock = threading.Lock()


@dataclasses.dataclass
class _SeedDraws:
    """Step seeds claimed in this process and the draws the caller's generator took for them,
    counted under ``global_generators_lock``: a seed claimed while another step's draw is
    pending (strategies stepping at once from two threads) skips it, so every step has a seed
    of its own."""

    claimed: int = 0
    taken: int = 0


_seed_draws = _SeedDraws()


class StepSeed:
    """The seed of one step: the number the caller's generator draws next as the step begins.
    Replicas read it from a copy of that generator; the caller's own takes one draw when the
    step ends, and only if some replica needed the seed. So mirrored draws nothing from the
    caller's generator while replicas run, where a save and restore of it in a replica thread
    (a ``fork_rng``) could undo the draw; draws others make from it meanwhile (a prefetching
    input's augmentations) are kept.

    Use it as a context manager around the step."""

    def __init__(self) -> None:
        self._start: torch.Tensor | None = None
        self._taken_at_start = 0
        self._seed: int | None = None

    def __enter__(self) -> StepSeed:
        with global_generators_lock:
            self._start = torch.default_generator.get_state()
            self._taken_at_start = _seed_draws.taken
        return self

    def get(self) -> int:
        with global_generators_lock:
            if self._seed is None:
                if self._start is None:
                    raise RuntimeError("a replica drew random numbers outside a step")
                copy = torch.Generator()
                copy.set_state(self._start)
                pending = _seed_draws.claimed - self._taken_at_start  # other steps' seeds
                # A draw for the step: not for each vmap-ped example, nor a traced step's fake.
                with outside_functorch(), outside_dispatch_modes():
                    draws = torch.empty(pending + 1, dtype=torch.int64).random_(generator=copy)
                    self._seed = int(draws[-1])
                _seed_draws.claimed += 1
            return self._seed

    def __exit__(self, *exc_info: object) -> None:
        if self._seed is not None:
            with global_generators_lock, outside_functorch():
                torch.empty((), dtype=torch.int64).random_()
                _seed_draws.taken += 1
