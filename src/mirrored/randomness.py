"""Per-replica random streams: dropout and other random ops differ across replicas, and a run is
reproducible bit for bit from ``torch.manual_seed``.

PyTorch's random ops draw from one process-wide generator per device, so replicas running at
once would interleave their draws nondeterministically. Each replica thread therefore runs under
a thread-local ``TorchFunctionMode`` that, around each random op only, swaps the replica's own
generator state into the global generator (under a lock) and back out.

The replicas' states for a step derive from one seed drawn from the caller's global generator,
the first time a replica of that step needs randomness. So a step without random ops leaves the
caller's random stream untouched (a shuffling DataLoader sees the same stream as in a plain
loop), and ``torch.manual_seed(s)`` before training reproduces it exactly.
Non-random ops pass through untouched (one Python call each, measured in benchmarks/overhead.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["ReplicaRandomness", "StepSeed"]

_global_rng_lock = threading.Lock()


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _always(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return True


def _dropout_fn(training_index: int, training_name: str, default: bool) -> Callable[..., bool]:
    def is_random(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        p = _arg(args, kwargs, 1, "p", 0.5)
        return bool(_arg(args, kwargs, training_index, training_name, default)) and p > 0

    return is_random


_ALWAYS_RANDOM: list[Callable[..., Any]] = [
    torch.rand,
    torch.rand_like,
    torch.randn,
    torch.randn_like,
    torch.randint,
    torch.randint_like,
    torch.randperm,
    torch.normal,
    torch.bernoulli,
    torch.multinomial,
    torch.poisson,
    torch.binomial,
    torch._standard_gamma,  # Gamma, Beta, Chi2 sampling
    torch._sample_dirichlet,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.bernoulli_,
    torch.Tensor.bernoulli,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
    torch.Tensor.multinomial,
    F.gumbel_softmax,
    F.fractional_max_pool2d,
    F.fractional_max_pool3d,
    torch.nn.init.uniform_,
    torch.nn.init.normal_,
    torch.nn.init.trunc_normal_,
    torch.nn.init.xavier_uniform_,
    torch.nn.init.xavier_normal_,
    torch.nn.init.kaiming_uniform_,
    torch.nn.init.kaiming_normal_,
    torch.nn.init.orthogonal_,
    torch.nn.init.sparse_,
]

_RANDOM_WHEN: dict[Callable[..., Any], Callable[[tuple[Any, ...], dict[str, Any]], bool]] = {
    **dict.fromkeys(_ALWAYS_RANDOM, _always),
    **dict.fromkeys(
        [
            F.dropout,
            F.dropout1d,
            F.dropout2d,
            F.dropout3d,
            F.alpha_dropout,
            F.feature_alpha_dropout,
        ],
        _dropout_fn(2, "training", True),
    ),
    **dict.fromkeys(
        [
            torch.dropout,
            torch.alpha_dropout,
            torch.feature_dropout,
            torch.feature_alpha_dropout,
            torch.native_dropout,
        ],
        _dropout_fn(2, "train", True),
    ),
    F.rrelu: lambda a, k: bool(_arg(a, k, 3, "training", False)),
    F.scaled_dot_product_attention: lambda a, k: _arg(a, k, 4, "dropout_p", 0.0) > 0,
    F.multi_head_attention_forward: lambda a, k: (
        bool(_arg(a, k, 13, "training", True)) and _arg(a, k, 10, "dropout_p", 0.0) > 0
    ),
}


class StepSeed:
    """The seed of one step, drawn from the caller's generator only if some replica needs it."""

    def __init__(self) -> None:
        self._seed: int | None = None

    def get(self) -> int:
        """Call under ``_global_rng_lock``, outside any replica's generator swap."""
        if self._seed is None:
            draw = torch.empty((), dtype=torch.int64).random_(generator=torch.default_generator)
            self._seed = int(draw)
        return self._seed


class ReplicaRandomness(TorchFunctionMode):
    """The random stream of one replica; enter it on the replica's thread around its work."""

    def __init__(self, replica_id: int, device: torch.device) -> None:
        super().__init__()
        self.replica_id = replica_id
        self.device = device
        self._step_seed = StepSeed()
        self._cpu_state: torch.Tensor | None = None
        self._device_state: torch.Tensor | None = None

    def start_step(self, step_seed: StepSeed) -> None:
        """Before a step: its states will derive from ``step_seed`` when first needed."""
        self._step_seed = step_seed
        self._cpu_state = None

    def _derive_states(self) -> None:
        words = np.random.SeedSequence([self._step_seed.get(), self.replica_id])
        seed = int(words.generate_state(1, np.uint64)[0])
        self._cpu_state = torch.Generator().manual_seed(seed).get_state()
        if self.device.type == "cuda":
            self._device_state = torch.Generator(device=self.device).manual_seed(seed).get_state()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        is_random = _RANDOM_WHEN.get(func)
        if is_random is None or not is_random(args, kwargs):
            return func(*args, **kwargs)
        with _global_rng_lock:
            if self._cpu_state is None:
                self._derive_states()
            assert self._cpu_state is not None
            saved_cpu = torch.default_generator.get_state()
            torch.default_generator.set_state(self._cpu_state)
            cuda_generator = None
            if self._device_state is not None:
                cuda_generator = torch.cuda.default_generators[self.device.index or 0]
                saved_device = cuda_generator.get_state()
                cuda_generator.set_state(self._device_state)
            try:
                return func(*args, **kwargs)
            finally:
                self._cpu_state = torch.default_generator.get_state()
                torch.default_generator.set_state(saved_cpu)
                if cuda_generator is not None:
                    self._device_state = cuda_generator.get_state()
                    cuda_generator.set_state(saved_device)
