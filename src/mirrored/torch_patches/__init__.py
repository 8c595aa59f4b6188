"""Every patch mirrored makes to torch, and the registries that serve them.

Some of torch's process-wide helpers would do the wrong thing inside replicas, which are threads
of one process: activation checkpointing would replay torch's global generators, gradient
clipping would clip a replica's part of the gradient, an LR scheduler would advance once per
replica, a ``GradScaler`` would share one state between the replicas' threads. Each is patched
where torch looks it up:

- :mod:`~mirrored.torch_patches.checkpoint`: ``torch.utils.checkpoint``'s two implementations
  (or, on a torch whose checkpoint module is not recognised, ``torch.get_rng_state``), held by
  every replica's random streams (``mirrored.random.routing.ReplicaRandomness``);
- :mod:`~mirrored.torch_patches.clipping`: ``clip_grad_norm_``, ``clip_grad_value_`` and the
  private helpers through which they read gradients;
- :mod:`~mirrored.torch_patches.schedulers`: the ``step`` of ``LRScheduler`` and of each
  subclass, and ``LRScheduler.__init_subclass__`` for subclasses defined later;
- :mod:`~mirrored.torch_patches.grad_scaler`: ``torch.amp.GradScaler.scale``;

the last three held by every mirrored optimizer, with the registries that tell them which
optimizers they serve (:mod:`~mirrored.torch_patches.mirrored_optimizers`). Each patch is
installed while it has a holder and removed, torch's own objects put back, with its last
(:mod:`~mirrored.torch_patches.holders`): a plain torch program run after every strategy is gone
runs torch unpatched.
"""

from __future__ import annotations

from mirrored.torch_patches.checkpoint import hold_checkpoint_routes
from mirrored.torch_patches.mirrored_optimizers import hold_optimizer_routes

__all__ = ["hold_checkpoint_routes", "hold_optimizer_routes"]
