"""The fourth article's multi-worker run: MobileNetV2 under ``MultiWorkerMirroredStrategy``.

Every worker runs this same program (as in Keras's multi-worker tutorial): it learns from
``TF_CONFIG`` which worker it is, builds and compiles the model inside ``strategy.scope()`` and
calls ``fit`` with a global batch of ``--batch-size-per-replica`` x all replicas of all workers.
The workers wait for each other, start from the chief's weights and end every step with the same
ones. Model, data and defaults are examples/mobilenet.py's (by default 3072 crops of
scikit-learn's two bundled photos at 64x64, 64 per replica, Adam 1e-3, 5 epochs) but for a
half-width network, with which two workers on two CPU cores finish in about 40 s (width 1.0: about
2 minutes); ``--data PetImages --image-size 224 --width-multiplier 1`` is the article's run.

Two workers on this machine, in two terminals (``--worker-index I`` builds the TF_CONFIG
``{"cluster": {"worker": ["127.0.0.1:12345", "127.0.0.1:12346"]}, "task": {"type": "worker",
"index": I}}``; ``--num-workers`` and ``--port`` change it):

    python -m mirrored.examples.multi_worker_mobilenet --worker-index 0
    python -m mirrored.examples.multi_worker_mobilenet --worker-index 1

or both at once with torchrun's environment (RANK, WORLD_SIZE, ...) instead of TF_CONFIG:

    mirrored launch --nproc-per-node 2 -m mirrored.examples.multi_worker_mobilenet

On real hosts set TF_CONFIG in each host's environment, the same cluster everywhere and each
host's own task, and leave out ``--worker-index``; then this program reads it as it stands.
Only the chief (worker 0) prints progress and the test results, and writes the backup.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from mirrored.examples.command_line import example_parser
from mirrored.examples.devices import positive_int
from mirrored.examples.distributed_loop import weights_path
from mirrored.examples.mobilenet import build_model, folder_datasets, photo_crops
from torch.utils.data import DataLoader

import mirrored
from mirrored import checkpoint

# The Keras tutorial's first worker. Worker i's address is port + i; the workers meet at worker 0's.
DEFAULT_PORT = 12345


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = example_parser(__doc__)
    _add_cluster_arguments(parser)
    _add_model_arguments(parser)
    _add_training_arguments(parser)
    args = parser.parse_args(argv)
    if args.width_multiplier <= 0:
        parser.error(f"--width-multiplier {args.width_multiplier}: expected a positive number")
    if args.workers < 0:
        parser.error(f"--workers {args.workers}: expected 0 or more")
    _check_cluster_arguments(parser, args)
    if args.image_size is None:
        args.image_size = 224 if args.data is not None else 64
    return args


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group(
        "cluster (when neither TF_CONFIG nor a launcher's RANK/WORLD_SIZE is set)"
    )
    cluster.add_argument(
        "--worker-index",
        type=int,
        help="this worker's index, 0 is the chief (default: the cluster of TF_CONFIG or the "
        "launcher; else one worker)",
    )
    cluster.add_argument(
        "--num-workers", type=positive_int, default=2, help="workers in all (default 2)"
    )
    cluster.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"worker 0's port (default {DEFAULT_PORT})"
    )


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model and data (examples/mobilenet.py's)")
    model.add_argument(
        "--data",
        type=Path,
        help="a folder with one sub-folder of images per class (default: crops of "
        "scikit-learn's two sample photos)",
    )
    model.add_argument(
        "--image-size", type=positive_int, help="pixels a side (default: 224 with --data, else 64)"
    )
    model.add_argument("--max-images", type=positive_int, help="default: all, or 3072 crops")
    model.add_argument("--width-multiplier", type=float, default=0.5, help="default 0.5")
    model.add_argument("--bn-momentum", type=float, default=0.5, help="see build_model there")
    model.add_argument("--workers", type=int, default=2, help="--data decoding processes")


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    training = parser.add_argument_group("training")
    training.add_argument(
        "--batch-size-per-replica",
        type=positive_int,
        default=64,
        help="global batch = this x replicas of all workers",
    )
    training.add_argument(
        "--epochs", type=positive_int, default=5, help="passes over the training set"
    )
    training.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    training.add_argument("--seed", type=int, default=0, help="seeds the data and the weights")
    training.add_argument("--verbose", type=int, choices=(0, 1, 2), help="fit's (default: auto)")
    training.add_argument(
        "--backup-dir", type=Path, help="BackupAndRestore's folder (default: no backups)"
    )
    training.add_argument(
        "--save",
        help="the trained weights' file, the chief's ('{rank}' in it: every worker's; "
        "default: not saved)",
    )


def _check_cluster_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--port, --num-workers and --worker-index fit each other and the environment."""
    if not 1 <= args.port <= 65535 - (args.num_workers - 1):
        parser.error(
            f"--port {args.port}: expected 1..{65535 - (args.num_workers - 1)} (worker i is "
            f"at port + i, {args.num_workers} workers)"
        )
    if args.worker_index is not None:
        if not 0 <= args.worker_index < args.num_workers:
            parser.error(
                f"--worker-index {args.worker_index}: expected 0..{args.num_workers - 1} "
                f"(--num-workers {args.num_workers})"
            )
        launched_by = [name for name in ("TF_CONFIG", "RANK") if os.environ.get(name)]
        if launched_by:
            parser.error(
                f"--worker-index {args.worker_index} but {launched_by[0]} is set: the cluster "
                f"comes from {launched_by[0]}; leave out --worker-index (or unset it)"
            )
    elif args.num_workers > 1 and not any(map(os.environ.get, ("TF_CONFIG", "RANK"))):
        parser.error(
            f"--num-workers {args.num_workers} needs --worker-index 0..{args.num_workers - 1} "
            "in each worker (or TF_CONFIG, or mirrored launch --nproc-per-node N -m ...)"
        )


def local_tf_config(num_workers: int, worker_index: int, port: int) -> dict[str, Any]:
    """The TF_CONFIG of worker ``worker_index`` of ``num_workers`` on this machine."""
    workers = [f"127.0.0.1:{port + i}" for i in range(num_workers)]
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": worker_index}}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train on every worker, then evaluate; returns the test ``loss`` and ``accuracy``."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    resolver = None  # TF_CONFIG or the launcher's variables, as the strategy finds them
    if args.worker_index is not None and args.num_workers > 1:
        tf_config = local_tf_config(args.num_workers, args.worker_index, args.port)
        resolver = mirrored.TFConfigClusterResolver(json.dumps(tf_config))
        if "OMP_NUM_THREADS" not in os.environ:
            # The workers share this machine's cores, as under mirrored launch: two workers of 2
            # threads each on 2 cores took 1.4 s a step of the tests' tiny run, of 1 each 0.11 s.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.num_workers))
    # Every worker builds the same data from the same seed; each then loads only its shards.
    if args.data is None:
        classes, datasets = photo_crops(args.max_images or 3072, args.image_size, args.seed)
        workers = 0  # already in memory
    else:
        classes, datasets = folder_datasets(args.data, args.image_size, args.seed, args.max_images)
        workers = args.workers

    with mirrored.MultiWorkerMirroredStrategy(cluster_resolver=resolver) as strategy:
        chief = strategy.cluster_resolver.is_chief
        global_batch_size = args.batch_size_per_replica * strategy.num_replicas_in_sync
        train, val, test = (
            DataLoader(
                dataset,
                batch_size=global_batch_size,
                shuffle=dataset is datasets[0],
                num_workers=workers,
                persistent_workers=workers > 0,
                generator=torch.Generator().manual_seed(args.seed),
            )
            for dataset in datasets
        )
        with strategy.scope():
            model = mirrored.Model(
                build_model(len(classes), args.width_multiplier, args.bn_momentum)
            )
            model.compile(
                optimizer=mirrored.optimizers.Adam(learning_rate=args.lr),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        if chief:
            print(strategy)
            print(
                f"{len(datasets[0])} train / {len(datasets[1])} val / {len(datasets[2])} test "
                f"images of {args.image_size}x{args.image_size}, classes {classes}; global batch "
                f"{global_batch_size} = {args.batch_size_per_replica} x "
                f"{strategy.num_replicas_in_sync} replicas"
            )
        callbacks = (
            [mirrored.callbacks.BackupAndRestore(args.backup_dir)] if args.backup_dir else []
        )
        verbose = "auto" if args.verbose is None else args.verbose
        start = time.perf_counter()
        model.fit(
            train, epochs=args.epochs, validation_data=val, callbacks=callbacks, verbose=verbose
        )
        if chief:
            print(f"trained in {time.perf_counter() - start:.1f} s")
        results = model.evaluate(test, verbose=0, return_dict=True)
        path = weights_path(args.save, strategy) if args.save else None
        if path is not None:
            checkpoint.save(model.state_dict(), path)
    if chief:
        print(" - ".join(f"test {name}: {value:.4f}" for name, value in results.items()))
    return results


if __name__ == "__main__":
    main()
