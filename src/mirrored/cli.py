"""The ``mirrored`` command.

    mirrored devices                       list physical and logical devices
    mirrored train EXAMPLE [flags]         run one of the users' programs (mirrored.examples)
    mirrored launch [flags] SCRIPT [args]  run SCRIPT in worker processes (mirrored.launch.launcher)

``mirrored train mnist_mlp --logical-devices 4`` trains the first article's model on four
logical CPU devices; ``mirrored train EXAMPLE --help`` lists an example's flags.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mirrored import config
from mirrored.launch import launcher as launch

__all__ = ["EXAMPLES", "main"]

EXAMPLES = {
    "mnist_mlp": "the first article's Sequential model on handwritten digits (fit)",
    "bert_mlm": "BERT-tiny masked-language model on 4 logical devices (the third article)",
    "mobilenet": "MobileNetV2 image classification, 64 images per replica (the fourth article)",
    "custom_training_loop": "an MLP with a hand-written loop on strategy.run",
    "multi_worker_mobilenet": "MobileNetV2 on MultiWorkerMirroredStrategy, two workers (the fourth "
    "article)",
    "distributed_loop": "the second article's torch.distributed loop on "
    "MultiWorkerMirroredStrategy",
    "model_parallel": "the second article's 784-512-256-10 MLP split across 3 devices "
    "(PipelineStrategy)",
}


def _devices() -> int:
    for device in config.list_physical_devices():
        print(f"physical  {device.name}  ({device.device_type})")
    for logical in config.list_logical_devices():
        limit = f", memory_limit={logical.memory_limit} MiB" if logical.memory_limit else ""
        print(f"logical   {logical.name}  on {logical.physical.name}{limit}")
    return 0


def _train(example: str, flags: Sequence[str]) -> int:
    if example not in EXAMPLES:
        known = ", ".join(EXAMPLES)
        print(
            f"mirrored train: unknown example {example!r}; choose one of: {known}", file=sys.stderr
        )
        return 2
    module = importlib.import_module(f"mirrored.examples.{example}")
    # The example's program name, as its --help and usage errors show it.
    command_line, sys.argv = sys.argv, [f"mirrored train {example}", *flags]
    try:
        module.main(list(flags))
    finally:
        sys.argv = command_line
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mirrored", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("devices", help="list physical and logical devices")
    train = commands.add_parser(
        "train",
        help="run an example program",
        description="Run an example; flags after EXAMPLE go to it (EXAMPLE --help lists them).",
        epilog="examples: " + "; ".join(f"{k}: {v}" for k, v in EXAMPLES.items()),
    )
    train.add_argument("example", help=f"one of {', '.join(EXAMPLES)}")
    train.add_argument("flags", nargs=argparse.REMAINDER, help="the example's own flags")
    launcher = commands.add_parser(
        "launch",
        help="run a script in worker processes (torchrun's environment, loopback-only store)",
        description="Run SCRIPT in worker processes; flags after SCRIPT go to it.",
    )
    launch.add_arguments(launcher)
    args = parser.parse_args(argv)
    if args.command == "devices":
        return _devices()
    if args.command == "launch":
        return launch.run_arguments(launcher, args)
    return _train(args.example, args.flags)


if __name__ == "__main__":
    sys.exit(main())
