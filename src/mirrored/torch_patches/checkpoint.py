"""torch's activation checkpointing made to recompute inside replicas with their own streams.

``torch.utils.checkpoint`` saves torch's global generators as a checkpoint's forward begins and
restores them around each recomputation in backward; replicas draw from generators of their own
(:mod:`mirrored.random.routing`). ``checkpoint()`` reaches its two implementations through its
module's globals at every call: ``CheckpointFunction`` (``use_reentrant=True``) and
``_checkpoint_without_reentrant_generator`` (``use_reentrant=False``). Both are replaced by
wrappers that, inside a replica, turn torch's save and restore off (it would read and write the
process-wide generators from several replica threads) and run each recomputation inside the
replica's replay instead; elsewhere they call torch's own, unchanged. Callers that bound
``checkpoint`` before (Hugging Face's models) go through them too.

On a torch whose checkpoint module is not what these wrappers expect nothing is wrapped, and
``torch.get_rng_state`` refuses on a replica's thread instead: every checkpoint that preserves
the random state calls it as its forward begins, so it raises there rather than recompute other
masks. The private names are reached, and recognised, in :mod:`mirrored._torch_internals`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.utils.checkpoint

from mirrored._torch_internals import replace_checkpoint_implementations, unrecognised_checkpoint
from mirrored.torch_patches.holders import Holding, Installation, Patch

__all__ = ["CHECKPOINTS", "hold_checkpoint_routes"]

# The replay of the calling thread's replica, made as a checkpoint's forward begins; None
# outside replicas.
Replay = Callable[[], AbstractContextManager[None] | None]

CHECKPOINTS = Patch("activation checkpoint")


def hold_checkpoint_routes(holder: object, replay: Replay) -> Holding:
    """Checkpoints inside replicas recompute inside ``replay()``'s context while ``holder`` (a
    replica's random streams) lives (see the module's docstring)."""
    install = functools.partial(_install_checkpoint_routes, replay=replay)
    return Holding(holder, [(CHECKPOINTS, install)])


def _install_checkpoint_routes(installation: Installation, replay: Replay) -> None:
    """The wrappers of torch's checkpoint implementations, or, on a torch whose checkpoint
    module is not recognised, the refusing ``torch.get_rng_state``."""
    module = torch.utils.checkpoint
    reason = unrecognised_checkpoint(module)
    if reason is None:
        replace_checkpoint_implementations(
            module,
            lambda base: _reentrant(base, replay, installation),
            lambda original: _non_reentrant(original, replay, installation),
            installation.replace,
        )
    else:
        refusing = _refusing_in_replicas(torch.get_rng_state, reason, replay, installation)
        installation.replace(torch, "get_rng_state", refusing)


class _Recompute:
    """A checkpointed function as a recomputation calls it: inside ``replay``."""

    def __init__(self, function: Callable[..., Any], replay: AbstractContextManager[None]) -> None:
        self._function = function
        self._replay = replay

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._replay:
            return self._function(*args, **kwargs)


def _replay_if_routed(
    replay: Replay, installation: Installation, preserve_rng_state: bool
) -> AbstractContextManager[None] | None:
    """What a checkpoint beginning now recomputes inside: the replica's replay, where torch
    would preserve the random state, the patch is in force and the caller is a replica."""
    return replay() if preserve_rng_state and installation.in_force else None


def _reentrant(base: Any, replay: Replay, installation: Installation) -> Any:
    class ReplicaCheckpointFunction(base):
        """torch's reentrant checkpoint; inside a replica, with ``preserve_rng_state``, its
        recomputations replay the replica's streams instead of torch's global generators."""

        @staticmethod
        def forward(
            ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any
        ) -> Any:
            recompute_in = _replay_if_routed(replay, installation, preserve_rng_state)
            if recompute_in is None:
                return base.forward(ctx, run_function, preserve_rng_state, *args)
            outputs = base.forward(ctx, run_function, False, *args)
            ctx.run_function = _Recompute(run_function, recompute_in)  # what backward calls
            return outputs

    return ReplicaCheckpointFunction


def _non_reentrant(
    original: Callable[..., Any], replay: Replay, installation: Installation
) -> Callable[..., Any]:
    @functools.wraps(original)
    def checkpoint_without_reentrant(
        fn: Callable[..., Any], preserve_rng_state: bool = True, *args: Any, **kwargs: Any
    ) -> Any:
        # torch's generator calls fn only to recompute (checkpoint() runs the forward itself).
        recompute_in = _replay_if_routed(replay, installation, preserve_rng_state)
        if recompute_in is not None:
            fn, preserve_rng_state = _Recompute(fn, recompute_in), False
        return original(fn, preserve_rng_state, *args, **kwargs)

    return checkpoint_without_reentrant


def _refusing_in_replicas(
    get_rng_state: Callable[..., torch.Tensor],
    reason: str,
    replay: Replay,
    installation: Installation,
) -> Callable[..., torch.Tensor]:
    """``get_rng_state`` that raises ``ValueError`` on a replica's thread (where ``replay()`` is
    not None: the global generator is not the replica's, and others use it), for a torch whose
    checkpoint module is not recognised (``reason``)."""

    @functools.wraps(get_rng_state)
    def refusing(*args: Any, **kwargs: Any) -> torch.Tensor:
        if installation.in_force and replay() is not None:
            raise ValueError(
                f"torch.get_rng_state() on a replica's thread: torch {torch.__version__} is not "
                f"the torch mirrored knows ({reason}), so a checkpoint's preserve_rng_state "
                "would restore torch's global generators, which replicas do not draw from. Pass "
                "use_reentrant=False, preserve_rng_state=False, "
                "context_fn=mirrored.activation_checkpoint_contexts to "
                "torch.utils.checkpoint.checkpoint (Hugging Face models: as "
                "gradient_checkpointing_kwargs)"
            )
        return get_rng_state(*args, **kwargs)

    return refusing
