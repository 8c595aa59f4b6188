"""``OneDeviceStrategy``: TensorFlow's strategy of one named device, the usual first step of a
port. The program's step runs on the caller's thread on that device, datasets are moved there,
and a model is placed there; ``num_replicas_in_sync`` is 1, so ``compute_average_loss`` and
``reduce`` mean what they mean on one device. It is a ``MirroredStrategy`` of one replica: the
same program grows to several devices by naming them.
"""

from __future__ import annotations

from mirrored.config import DeviceSpec, LogicalDevice
from mirrored.strategies.mirrored import MirroredStrategy

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(MirroredStrategy):
    """The program on one device (TensorFlow's ``tf.distribute.OneDeviceStrategy``).

    Args:
        device: the device, in either spelling: ``"cuda:0"``, ``"/gpu:0"``, ``"cpu:0"`` or a
            logical device of ``mirrored.config``.
        timeout_seconds: as ``MirroredStrategy``'s (a step that makes no progress).
    """

    def __init__(
        self, device: DeviceSpec | LogicalDevice, *, timeout_seconds: float | None = 1800.0
    ) -> None:
        if isinstance(device, (list, tuple, set)):
            raise TypeError(
                f"OneDeviceStrategy takes one device, got {device!r}; for several use "
                "mirrored.MirroredStrategy([...])"
            )
        super().__init__([device], timeout_seconds=timeout_seconds)

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={self.devices[0].short_name!r})"
