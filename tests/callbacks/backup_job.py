"""A training job for the BackupAndRestore tests: ``python backup_job.py BACKUP_DIR OUT [N]``.

Trains a small dropout MLP for 3 epochs on N logical CPU devices with BackupAndRestore backing up
after every batch, then writes the final weights to OUT. Killed and started again, it must write
exactly the weights of a run that was never interrupted.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import mirrored
from mirrored import config


def main(backup_dir: str, out: str, num_replicas: int) -> None:
    config.set_logical_device_configuration(
        config.list_physical_devices("CPU")[0],
        [config.LogicalDeviceConfiguration()] * num_replicas,
    )
    torch.manual_seed(0)
    x = torch.randn(203, 12)
    y = torch.randint(0, 5, (203,))
    module = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 5))
    slow = mirrored.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: time.sleep(0.02))
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)]) as strategy:
        with strategy.scope():
            model = mirrored.Model(module)
            model.compile(
                optimizer=mirrored.optimizers.Adam(
                    mirrored.optimizers.schedules.PolynomialDecay(1e-2, 39, 1e-4)
                ),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        history = model.fit(
            x,
            y,
            batch_size=16,
            epochs=3,
            verbose=0,
            callbacks=[slow, mirrored.callbacks.BackupAndRestore(backup_dir, save_freq=1)],
        )
    torch.save({"weights": model.state_dict(), "history": history.history}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2)
