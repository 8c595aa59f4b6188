"""The programs the multi-process tests run, one function per job: ``python -m
tests.multiprocess.jobs JOB OUT_DIR [ARGS]``. Each worker writes ``OUT_DIR/rank{R}.pt``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import mirrored
from mirrored import config
from tests.reference_loops import OPTIMIZERS, make_batches, make_mlp, train_mirrored


def _strategy() -> mirrored.MultiWorkerMirroredStrategy:
    return mirrored.MultiWorkerMirroredStrategy(
        communication_options=mirrored.CommunicationOptions(timeout_seconds=30)
    )


def custom_loop(out: Path, optimizer: str = "sgd") -> None:
    """The reference custom loop on the MLP, ragged last batch included."""
    strategy = _strategy()
    model = make_mlp()
    mirrored_model, _, losses = train_mirrored(
        strategy, model, OPTIMIZERS[optimizer](model), make_batches()
    )
    rank = strategy.worker_group.rank
    replicas = [r.state_dict() for r in mirrored_model.replicas]
    torch.save({"losses": losses, "replicas": replicas}, out / f"rank{rank}.pt")
    strategy.close()


JOBS: dict[str, Callable[..., None]] = {"custom_loop": custom_loop}


def main() -> None:
    job, out, *args = sys.argv[1:]
    logical = int(os.environ.get("MIRRORED_TEST_LOGICAL_DEVICES", "1"))
    config.set_logical_device_configuration(
        config.list_physical_devices("CPU")[0], [config.LogicalDeviceConfiguration()] * logical
    )
    JOBS[job](Path(out), *args)


if __name__ == "__main__":
    main()
