"""torch's LR schedulers made to advance once per update when every replica steps them.

A scheduler stepped inside replicas would advance once per replica: the ``step`` methods of
torch's ``LRScheduler`` and of every other subclass that defines its own (torch's, a third
party's; defined before the patch or while it is installed, through ``LRScheduler.
__init_subclass__``) are wrapped so that a caller may skip them there
(:mod:`mirrored.torch_patches.mirrored_optimizers`). In a step being traced
(:func:`mirrored.function`) they are recorded to step at each replay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from mirrored.core.trace_recording import deferred_to_replay
from mirrored.torch_patches.holders import Installation, Patch

__all__ = ["SCHEDULERS", "install_step_routes"]

SCHEDULERS = Patch("LR scheduler steps")


def install_step_routes(
    installation: Installation, base: type, skip: Callable[[Any], bool]
) -> None:
    """Route the ``step`` of ``base`` and of each of its subclasses that defines one: those that
    exist now, and, through ``base.__init_subclass__``, those defined while ``installation`` is
    in force."""
    pending = [base]
    while pending:
        cls = pending.pop()
        _route_step(installation, cls, skip)
        pending.extend(cls.__subclasses__())
    previous = base.__dict__.get("__init_subclass__")

    def init_subclass(cls: type, **kwargs: Any) -> None:
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]
        _route_step(installation, cls, skip)

    installation.replace(base, "__init_subclass__", classmethod(init_subclass))


def _route_step(installation: Installation, cls: type, skip: Callable[[Any], bool]) -> None:
    """``cls.step``, if ``cls`` defines its own, made to do nothing where ``skip(self)`` while
    ``installation`` is in force (a class reached twice, through two bases, once)."""
    original = cls.__dict__.get("step")
    if not callable(original) or getattr(original, "_routed_by", None) is installation:
        return

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        # In a traced step the scheduler steps at each replay.
        if installation.in_force and (
            deferred_to_replay(step, self, *args, **kwargs) or skip(self)
        ):
            return None
        return original(self, *args, **kwargs)

    step._routed_by = installation  # type: ignore[attr-defined]
    installation.replace(cls, "step", step)
