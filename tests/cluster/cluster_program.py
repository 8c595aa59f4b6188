"""One program run three ways to the same final weights: ``python -m
tests.cluster.cluster_program OUT`` plain (one worker), in the tasks of an ``srun`` step or under
the variables srun sets (tests/cluster/test_slurm.py), and with ``--ray ADDRESS`` in 2 workers of
Ray Train's ``TorchTrainer`` on the Ray cluster at ADDRESS (tests/cluster/test_ray.py).

``MultiWorkerMirroredStrategy()`` has no arguments, so the environment, or the process group Ray
formed, alone says who the workers are; each trains the reference MLP in float64 and saves its
weights, losses and resolver as ``OUT/rank{R}.pt``. The tests read them with the helpers below.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import mirrored
from tests.exactness import assert_close_float64
from tests.multiprocess.spawn import program_env
from tests.reference_loops import OPTIMIZERS, make_batches, make_mlp, train_mirrored

COMMAND = [sys.executable, "-m", "tests.cluster.cluster_program"]


def train(out: Path) -> None:
    """What every worker runs."""
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


def train_in_ray(config: dict[str, str]) -> None:
    """A Ray Train worker: ``train`` in the process group Ray formed."""
    train(Path(config["out"]))


def run_in_ray(out: Path, address: str) -> None:
    """``train`` in 2 CPU workers of ``TorchTrainer``, which forms their process group over TCP
    (``init_method="tcp"``: no MASTER_ADDR or MASTER_PORT in their environment); Ray's own
    files of the run go to ``OUT/ray``."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=address)
    try:
        TorchTrainer(
            train_in_ray,
            train_loop_config={"out": str(out)},
            torch_config=TorchConfig(backend="gloo", init_method="tcp"),
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=ray.train.RunConfig(name="cluster-program", storage_path=str(out / "ray")),
        ).fit()
    finally:
        ray.shutdown()


def plain_env() -> dict[str, str]:
    """A test program's environment, less any cluster the tests themselves run in."""
    return {
        k: v
        for k, v in program_env().items()
        if not k.startswith("SLURM_") and k not in ("MASTER_ADDR", "MASTER_PORT")
    }


def results(out: Path, num_workers: int) -> list[dict[str, Any]]:
    """What each worker of a run saved."""
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(num_workers)]


def assert_trained_as_one_process(out: Path, plain: dict[str, Any], resolver: str) -> None:
    """Both workers of a run found their place with ``resolver`` and end where the plain run's
    one process does (float64: to rounding); their replicas are bit-identical."""
    saved = results(out, 2)
    for result in saved:
        assert (result["resolver"], result["world_size"]) == (resolver, 2)
        for name, value in plain["weights"].items():
            assert_close_float64(result["weights"][name], value, msg=name)
        assert_close_float64(result["losses"], plain["losses"])
    first, second = (result["weights"] for result in saved)
    assert all(torch.equal(first[name], second[name]) for name in first)


def main() -> None:
    out = Path(sys.argv[1])
    if sys.argv[2:3] == ["--ray"]:
        run_in_ray(out, sys.argv[3])
    else:
        train(out)


if __name__ == "__main__":
    main()
