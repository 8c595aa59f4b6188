"""``MultiWorkerMirroredStrategy`` inside Ray Train's ``TorchTrainer``, with checkpoints kept by
Ray.

Ray Train starts the workers and forms the ``torch.distributed`` process group before the
training function runs. The strategy reads who each worker is from that group
(``ProcessGroupClusterResolver``), joins it instead of forming its own, and leaves it to Ray when
it closes. After every epoch every worker calls ``mirrored.Checkpoint.write`` (the chief
alone writes the file) into a folder that the chief hands to ``ray.train.report``; Ray copies it
to the run's storage. A worker group that Ray starts again (after a failed worker, with
``--max-failures``) or the same command run again with the same ``--name`` and
``--storage-path`` gets it back from ``ray.train.get_checkpoint()`` and resumes from it: epoch e
shuffles with seed + e, so a resumed run ends with the weights of an uninterrupted one.

The model and data are examples/distributed_loop.py's: the first article's MLP on scikit-learn's
8x8 digits, SGD with momentum, 100 examples per replica.

    pip install -e '.[examples,ray]'               # in the repository's root
    python examples/ray_train.py                   # a local Ray cluster with 2 CPU workers
    python examples/ray_train.py --address auto    # the Ray cluster this machine belongs to

On a Ray cluster of several machines, every machine needs mirrored installed as here, and
``--storage-path`` a folder that every machine reaches (shared storage).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from mirrored.examples import distributed_loop
from mirrored.examples.command_line import example_parser
from mirrored.examples.custom_training_loop import eval_step, run_epoch, train_step
from mirrored.examples.devices import positive_int
from mirrored.examples.mnist_mlp import build_model, load_digits_split, load_mnist
from torch.utils.data import DataLoader, TensorDataset

import mirrored

try:
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer
except ImportError as error:
    raise ImportError(
        f"examples/ray_train.py needs Ray Train ({error}); pip install 'ray[train]'"
    ) from error

# The file of a mirrored.Checkpoint inside each checkpoint folder Ray keeps.
CHECKPOINT_FILE = "checkpoint.pt"
TRAINING_OPTIONS = """\
training options: examples/distributed_loop.py's (--data, --epochs 10, --batch-size-per-replica
100, --lr 0.1, --momentum 0.9, --hidden 64, --seed 0), but --checkpoint: Ray keeps the
checkpoints of a run (--storage-path, --name)"""


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The options of Ray's run, and ``train_func``'s config: distributed_loop.py's options and
    ``--float64``."""
    parser = example_parser(__doc__, epilog=TRAINING_OPTIONS)
    parser.add_argument("--num-workers", type=positive_int, default=2, help="Ray Train workers")
    parser.add_argument("--use-gpu", action="store_true", help="a GPU per worker (NCCL)")
    parser.add_argument(
        "--address",
        help="the Ray cluster to join ('auto': the one this machine belongs to; default: start "
        "a local one with a CPU per worker)",
    )
    parser.add_argument("--storage-path", type=Path, help="where Ray keeps runs (default: Ray's)")
    parser.add_argument(
        "--name", default="mirrored-ray-train", help="the run; the same name resumes it"
    )
    parser.add_argument("--max-failures", type=int, default=0, help="worker group restarts")
    parser.add_argument(
        "--float64", action="store_true", help="train in float64 (to compare runs exactly)"
    )
    args, rest = parser.parse_known_args(argv)
    training = distributed_loop.parse_args(rest)
    if training.checkpoint is not None:
        parser.error(
            f"--checkpoint {training.checkpoint}: Ray keeps the checkpoints of a run; choose "
            "where with --storage-path and --name"
        )
    return args, {**vars(training), "float64": args.float64}


def datasets(data: Path | None, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """distributed_loop.py's (train, test) sets, in torch's default dtype."""
    (x, y), (x_test, y_test) = load_mnist(data) if data else load_digits_split(seed)
    dtype = torch.get_default_dtype()
    return (
        TensorDataset(torch.from_numpy(x).to(dtype), torch.from_numpy(y)),
        TensorDataset(torch.from_numpy(x_test).to(dtype), torch.from_numpy(y_test)),
    )


def train_func(config: dict[str, Any]) -> None:
    """What every Ray Train worker runs: the strategy joins the process group Ray formed."""
    if config["float64"]:
        torch.set_default_dtype(torch.float64)
    train_set, test_set = datasets(config["data"], config["seed"])
    with mirrored.MultiWorkerMirroredStrategy() as strategy:
        if strategy.should_checkpoint:
            print(strategy)  # MultiWorkerMirroredStrategy(worker 0 of 2, ...)
        global_batch_size = config["batch_size_per_replica"] * strategy.num_replicas_in_sync
        torch.manual_seed(config["seed"])
        with strategy.scope():
            model = build_model(train_set.tensors[0].shape[1], config["hidden"], 10)
            optimizer = torch.optim.SGD(
                model.parameters(), lr=config["lr"], momentum=config["momentum"]
            )
        mirrored_model, mirrored_optimizer = strategy.mirror(model, optimizer)
        epochs_done = torch.zeros((), dtype=torch.int64)
        checkpoint = mirrored.Checkpoint(
            model=mirrored_model, optimizer=mirrored_optimizer, epoch=epochs_done
        )
        restore(checkpoint)
        train = functools.partial(train_step, mirrored_model, mirrored_optimizer)
        evaluate = functools.partial(eval_step, mirrored_model)
        test_loader = DataLoader(test_set, global_batch_size)
        for epoch in range(int(epochs_done) + 1, config["epochs"] + 1):
            generator = torch.Generator().manual_seed(config["seed"] + epoch)
            loader = DataLoader(train_set, global_batch_size, shuffle=True, generator=generator)
            train_loss, train_correct = run_epoch(strategy, train, loader)
            test_loss, test_correct = run_epoch(strategy, evaluate, test_loader)
            epochs_done.fill_(epoch)
            metrics = {
                "epoch": epoch,
                "loss": train_loss / len(train_set),
                "accuracy": train_correct / len(train_set),
                "test_loss": test_loss / len(test_set),
                "test_accuracy": test_correct / len(test_set),
            }
            report(strategy, checkpoint, metrics)


def restore(checkpoint: mirrored.Checkpoint) -> None:
    """Where Ray's last checkpoint of this run left off, if it has one (every worker reads it)."""
    saved = ray.train.get_checkpoint()
    if saved is None:
        return
    with saved.as_directory() as folder:
        checkpoint.restore(Path(folder) / CHECKPOINT_FILE)
    if ray.train.get_context().get_world_rank() == 0:
        print(f"resumed after epoch {int(checkpoint.epoch)}")


def report(
    strategy: mirrored.MultiWorkerMirroredStrategy,
    checkpoint: mirrored.Checkpoint,
    metrics: dict[str, float],
) -> None:
    """Every worker reports (Ray waits for all of them); the chief's folder holds the file."""
    with tempfile.TemporaryDirectory() as folder:
        checkpoint.write(Path(folder) / CHECKPOINT_FILE)  # every worker: the chief writes
        kept = ray.train.Checkpoint.from_directory(folder) if strategy.should_checkpoint else None
        ray.train.report(metrics, checkpoint=kept)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args, config = parse_args(argv)
    storage_path = None if args.storage_path is None else str(args.storage_path.resolve())
    if args.address is None:
        ray.init(address="local", num_cpus=args.num_workers, include_dashboard=False)
    else:
        ray.init(address=args.address)
    try:
        trainer = TorchTrainer(
            train_func,
            train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(
                num_workers=args.num_workers, use_gpu=args.use_gpu
            ),
            run_config=ray.train.RunConfig(
                name=args.name,
                storage_path=storage_path,
                failure_config=ray.train.FailureConfig(max_failures=args.max_failures),
                checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            ),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    assert result.checkpoint is not None  # every epoch reports one
    metrics = " - ".join(f"{name}: {value:.4f}" for name, value in result.metrics.items())
    print(metrics)
    print(f"checkpoint: {result.checkpoint.path}/{CHECKPOINT_FILE}")
    return {**result.metrics, "checkpoint": f"{result.checkpoint.path}/{CHECKPOINT_FILE}"}


if __name__ == "__main__":
    main(sys.argv[1:])
