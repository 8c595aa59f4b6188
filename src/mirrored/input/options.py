"""How a distributed dataset is read: TensorFlow's ``tf.distribute.InputOptions``."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["InputOptions", "checked_options", "input_settings"]


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How a distributed dataset is read (TensorFlow's ``tf.distribute.InputOptions``): given
    to ``experimental_distribute_dataset``, or to ``Model.compile(input_options=...)`` for fit,
    evaluate and predict (``batch_dim`` only: they read each batch as they run it).

    Args:
        experimental_per_replica_buffer_size: global batches read, split and copied to the
            devices ahead of the training, on a background thread (:mod:`mirrored.input.prefetch`);
            0 reads each when the loop asks for it. Off by default: a dataset that draws from
            torch's global generator as it reads (random augmentation in the main process)
            would draw from it concurrently with the training, in no fixed order.
        batch_dim: the dimension each global batch is split along, for every tensor of it: 1
            for sequence-first data (``[seq, batch, ...]``, as ``nn.LSTM`` and
            ``nn.Transformer`` take by default). A tensor with fewer dimensions than that, other
            than a scalar, is refused: keep targets ``[seq, batch]`` and flatten them inside the
            step.
    """

    experimental_per_replica_buffer_size: int = 0
    batch_dim: int = 0

    def __post_init__(self) -> None:
        for name, hint in (
            ("experimental_per_replica_buffer_size", "0: no reading ahead"),
            ("batch_dim", "0: the first dimension"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"InputOptions({name}={value!r}): expected a whole number >= 0 ({hint})"
                )


def checked_options(options: Any, argument: str = "options") -> InputOptions:
    """``options`` itself, or the defaults for None; a TypeError naming ``argument`` for
    anything but ``InputOptions``."""
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(
            f"{argument}={options!r}: expected mirrored.InputOptions("
            "experimental_per_replica_buffer_size=..., batch_dim=...)"
        )
    return options


def input_settings(options: InputOptions | None) -> tuple[int, int]:
    """``(batches read ahead, batch dimension)`` of ``options`` (a TypeError for anything but
    InputOptions)."""
    options = checked_options(options)
    return options.experimental_per_replica_buffer_size, options.batch_dim
