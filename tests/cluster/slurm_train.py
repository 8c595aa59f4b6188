"""The program of the SLURM tests: ``python -m tests.cluster.slurm_train OUT`` under ``srun``,
under the variables srun sets, or plain. ``MultiWorkerMirroredStrategy()`` has no arguments, so
the environment alone says who the workers are; each trains the reference MLP in float64 and
saves its weights, losses and resolver as ``OUT/rank{R}.pt``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import mirrored
from tests.reference_loops import OPTIMIZERS, make_batches, make_mlp, train_mirrored


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_default_dtype(torch.float64)
    with mirrored.MultiWorkerMirroredStrategy() as strategy:
        model = make_mlp()
        optimizer = OPTIMIZERS["adam"](model)
        mirrored_model, _, losses = train_mirrored(strategy, model, optimizer, make_batches())
        resolver = strategy.cluster_resolver
        result = {
            "weights": mirrored_model.replicas[0].state_dict(),
            "losses": losses,
            "resolver": type(resolver).__name__,
            "world_size": resolver.world_size,
        }
        torch.save(result, out / f"rank{resolver.rank}.pt")


if __name__ == "__main__":
    main()
