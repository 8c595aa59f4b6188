"""``CentralStorageStrategy``: TensorFlow's strategy of parameters on one device, compute mirrored.

Each compute device runs a replica of the step on its shard of the global batch, as under
``MirroredStrategy``; the gradients are summed onto the parameter device
(``ReductionToOneDevice``: no peer-to-peer traffic between the compute devices, which is what
fits GPUs without peer links), and the optimizer's state and update live there, once
(:mod:`mirrored.replication.central_update`). With several GPUs the parameter device is the CPU by
default, so the optimizer state (and the central copy of the parameters) costs no GPU memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mirrored import config
from mirrored.comm.cross_device_ops import ReductionToOneDevice
from mirrored.config import DeviceSpec, LogicalDevice
from mirrored.replication.central_update import CentralUpdate
from mirrored.strategies.mirrored import MirroredStrategy, local_devices

__all__ = ["CentralStorageStrategy"]


class CentralStorageStrategy(MirroredStrategy):
    """Compute mirrored over local devices, parameters and their update on one
    (TensorFlow's ``tf.distribute.experimental.CentralStorageStrategy``).

    Args:
        compute_devices: the devices the replicas run on; None: every local GPU, or every
            logical CPU device when there is no GPU.
        parameter_device: where the optimizer state lives and the update runs; None, as in
            TensorFlow: the one compute device when there is one, else the CPU (the first CPU
            compute device, or ``cpu:0``).
        timeout_seconds: as ``MirroredStrategy``'s.
        gradient_accumulation_steps: as ``MirroredStrategy``'s.
        check_replicas: as ``MirroredStrategy``'s.

    The model a program holds is replica 0's, whose parameters equal the parameter device's after
    every update; the mirrored optimizer's ``state_dict()`` is the parameter device's optimizer's.
    ``optimizer.step(closure)`` (LBFGS) is refused: use ``MirroredStrategy`` for it.
    """

    def __init__(
        self,
        compute_devices: Sequence[DeviceSpec | LogicalDevice] | None = None,
        parameter_device: DeviceSpec | LogicalDevice | None = None,
        *,
        timeout_seconds: float | None = 1800.0,
        gradient_accumulation_steps: int = 1,
        check_replicas: bool | None = None,
    ) -> None:
        compute = local_devices(compute_devices)
        self.parameter_device = _parameter_device(compute, parameter_device)
        super().__init__(
            compute,
            ReductionToOneDevice(reduce_to_device=self.parameter_device),
            timeout_seconds=timeout_seconds,
            gradient_accumulation_steps=gradient_accumulation_steps,
            check_replicas=check_replicas,
        )

    def central_update(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[torch.nn.Parameter]],
    ) -> CentralUpdate:
        """The update of a new mirrored optimizer, on the parameter device."""
        devices = list(self.devices)
        owner = devices.index(self.parameter_device) if self.parameter_device in devices else None
        return CentralUpdate(optimizers, params, self.parameter_device.torch_device, owner)

    def __repr__(self) -> str:
        return (
            f"CentralStorageStrategy(compute_devices={[d.short_name for d in self.devices]}, "
            f"parameter_device={self.parameter_device.short_name!r})"
        )


def _parameter_device(
    compute: Sequence[LogicalDevice], parameter_device: DeviceSpec | LogicalDevice | None
) -> LogicalDevice:
    """The logical parameter device given, or TensorFlow's default for ``compute``."""
    if isinstance(parameter_device, (list, tuple, set)):
        raise TypeError(
            f"parameter_device={parameter_device!r}: it is one device, such as 'cpu:0'; the "
            "replicas' devices are compute_devices"
        )
    if parameter_device is not None:
        return config.resolve_devices([parameter_device])[0]
    if len(compute) == 1:
        return compute[0]
    cpus = [d for d in compute if d.device_type == "CPU"]
    return cpus[0] if cpus else config.resolve_devices(["cpu:0"])[0]
