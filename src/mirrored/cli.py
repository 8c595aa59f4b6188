"""The ``mirrored`` command: list the devices, run the users' programs, launch worker processes.

``mirrored train mnist_mlp --logical-devices 4`` trains the first article's model on four
logical CPU devices; ``mirrored train EXAMPLE --help`` lists an example's flags;
``mirrored launch`` runs a script in worker processes (``mirrored.launch.launcher``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import mirrored
from mirrored import config
from mirrored.examples.command_line import HelpFormatter
from mirrored.launch import launcher as launch

__all__ = ["EXAMPLES", "main"]

# One line each in `mirrored train --help`: at most 72 characters, so that the list fits 100.
EXAMPLES = {
    "mnist_mlp": "the first article's Sequential model on handwritten digits (fit)",
    "bert_mlm": "the third article's BERT-tiny masked-language model, 4 logical devices",
    "mobilenet": "the fourth article's MobileNetV2, 64 images per replica",
    "custom_training_loop": "an MLP with a hand-written loop on strategy.run",
    "multi_worker_mobilenet": "the fourth article's MobileNetV2 on two workers",
    "distributed_loop": "the second article's torch.distributed loop, on two workers",
    "model_parallel": "the second article's 784-512-256-10 MLP split over 3 devices",
}

_DESCRIPTION = """\
TensorFlow's distribution strategies for PyTorch: list the devices, train one of the users'
programs, or run a script in worker processes."""
_EPILOG = """\
for example:
  mirrored devices
  mirrored train mnist_mlp --logical-devices 4  the first article's model on 4 logical devices
  mirrored train mnist_mlp --help               that example's own flags
  mirrored launch --nproc-per-node 2 train.py   train.py in 2 worker processes"""


class _Formatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """Options show their defaults; descriptions and epilogs keep their lines."""


def _examples_epilog() -> str:
    width = max(map(len, EXAMPLES)) + 2
    lines = [f"  {name:<{width}}{text}" for name, text in EXAMPLES.items()]
    return "\n".join(["examples:", *lines])


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


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``mirrored`` parser, and its ``launch`` subcommand's (which reports its errors)."""
    parser = argparse.ArgumentParser(
        prog="mirrored", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_Formatter
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"mirrored {mirrored.__version__}",
        help="print mirrored's version and exit",
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="one of"
    )
    commands.add_parser(
        "devices", help="list physical and logical devices", formatter_class=_Formatter
    )
    train = commands.add_parser(
        "train",
        help="run one of the users' programs (EXAMPLE --help lists its flags)",
        description="Run an example program; flags after EXAMPLE go to it (EXAMPLE --help "
        "lists them).",
        epilog=_examples_epilog(),
        formatter_class=_Formatter,
    )
    train.add_argument("example", metavar="EXAMPLE", help="one of the examples below")
    train.add_argument("flags", nargs=argparse.REMAINDER, help="the example's own flags")
    launcher = commands.add_parser(
        "launch",
        help="run a script in worker processes (torchrun's environment, loopback-only store)",
        description="Run SCRIPT in worker processes; flags after SCRIPT go to it.",
        formatter_class=_Formatter,
    )
    launch.add_arguments(launcher)
    return parser, launcher


def main(argv: Sequence[str] | None = None) -> int:
    parser, launcher = _parsers()
    args = parser.parse_args(argv)
    if args.command == "devices":
        return _devices()
    if args.command == "launch":
        return launch.run_arguments(launcher, args)
    return _train(args.example, args.flags)


if __name__ == "__main__":
    sys.exit(main())
