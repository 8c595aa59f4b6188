"""Loss scaling for synchronous data parallelism.

Each replica's loss is divided by the *global* batch size, not its shard's, so that summing the
replicas' gradients gives exactly the gradient of the mean loss over the global batch, whatever
the split (ragged last batch and empty shards included).
"""

from __future__ import annotations

import torch

from mirrored.context import current_replica_context
from mirrored.values import ReduceOp

__all__ = ["compute_average_loss"]


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """Sum of (weighted) per-example losses divided by the global batch size.

    The global batch size is, in order: the argument; the size of the distributed batch passed to
    ``strategy.run``; the sum of the replicas' example counts (one all-reduce). Outside a replica
    function it is this batch's size, which makes this the plain mean.
    """
    if not isinstance(per_example_loss, torch.Tensor) or per_example_loss.dim() == 0:
        raise ValueError(
            "per_example_loss must be a tensor with a batch dimension (one loss per example); "
            "compute it with reduction='none'"
        )
    loss = per_example_loss if sample_weight is None else per_example_loss * sample_weight
    total = loss.sum()
    if global_batch_size is None:
        replica = current_replica_context()
        local = per_example_loss.shape[0]
        if replica is None or replica.num_replicas_in_sync == 1:
            global_batch_size = local
        elif replica.global_batch_size is not None:
            global_batch_size = replica.global_batch_size
        else:
            global_batch_size = int(replica.all_reduce(ReduceOp.SUM, local))
    elif not isinstance(global_batch_size, int) or global_batch_size <= 0:
        raise ValueError(f"global_batch_size={global_batch_size!r}: expected a positive int")
    return total / max(global_batch_size, 1)
