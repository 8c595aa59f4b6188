"""``TensorBoard``: write the training curves for TensorBoard (Keras's callback, on
``torch.utils.tensorboard``).

The layout is Keras's, so dashboards and habits carry over: ``log_dir/train`` and
``log_dir/validation`` runs, ``epoch_loss`` / ``epoch_<metric>`` at each epoch (``val_`` logs go to
the validation run under the same tag), ``epoch_learning_rate``, and with ``update_freq=N``
``batch_<name>`` every N training batches against the global step, and the epoch's training
throughput in steps and (when ``fit`` reports batch sizes) examples per second, timed from the
epoch's start to its last training batch, validation excluded (``write_steps_per_second=False``
leaves it out; Keras's default is False, the throughput is worth having by default).
Only the process that writes checkpoints writes summaries.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from mirrored.callbacks.callback import Callback, Logs

__all__ = ["TensorBoard"]

# Per-batch logs that are bookkeeping, not results.
_HIDDEN = {"num_examples"}


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "TensorBoard needs the tensorboard package: pip install 'mirrored[tensorboard]'"
        ) from error
    return SummaryWriter


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TensorBoard(Callback):
    """Log losses, metrics, the learning rate and (optionally) throughput and weight histograms.

    ``update_freq``: "epoch", "batch" (every batch) or N (every N training batches) for the
    ``batch_`` scalars. ``histogram_freq``: every N epochs, a histogram of each weight
    (0: never). Not supported from Keras: graphs, images, profiling and embeddings.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] = "logs",
        histogram_freq: int = 0,
        *,
        write_steps_per_second: bool = True,
        update_freq: str | int = "epoch",
    ) -> None:
        super().__init__()
        self._writer_class = _summary_writer_class()
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and (
            not isinstance(update_freq, int) or isinstance(update_freq, bool) or update_freq <= 0
        ):
            raise ValueError(
                f"TensorBoard: update_freq={update_freq!r}; expected 'epoch', 'batch' or a "
                "positive number of batches"
            )
        if (
            not isinstance(histogram_freq, int)
            or isinstance(histogram_freq, bool)
            or histogram_freq < 0
        ):
            raise ValueError(
                f"TensorBoard: histogram_freq={histogram_freq!r}; expected an int >= 0"
            )
        self.log_dir = Path(log_dir)
        self.histogram_freq = histogram_freq
        self.write_steps_per_second = write_steps_per_second
        self.update_freq = update_freq
        self._writers: dict[str, Any] = {}
        self._in_fit = False
        self._global_step = 0
        self._first_batch = 0
        self._batch_start = 0.0
        self._epoch_start = 0.0
        self._epoch_steps = 0
        self._epoch_examples: int | None = None
        self._train_seconds = 0.0

    # -- writers -----------------------------------------------------------------------------------
    def _writer(self, run: str) -> Any:
        """The writer of ``log_dir/run``, opened on first use; None where this process does not
        write summaries."""
        if not self.fit_model().strategy.should_checkpoint:
            return None
        if run not in self._writers:
            self._writers[run] = self._writer_class(log_dir=str(self.log_dir / run))
        return self._writers[run]

    def _close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    # -- hooks -------------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._close()  # a previous fit that raised may have left writers open
        self._in_fit = True
        self._global_step = 0
        self._writer("train")

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._in_fit = False
        self._close()

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch_start = time.perf_counter()
        self._epoch_steps = 0
        self._epoch_examples = None
        self._train_seconds = 0.0

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        self._first_batch = batch
        self._batch_start = time.perf_counter()

    def reads_batch_logs(self, hook: str) -> bool:
        # Every batch counts its examples (always in the logs); metrics go out per batch only.
        return hook == "on_train_batch_end" and self.update_freq != "epoch"

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        now = time.perf_counter()
        logs = logs or {}
        steps = batch - self._first_batch + 1  # several with steps_per_execution > 1
        before = self._global_step
        self._global_step += steps
        self._epoch_steps += steps
        self._train_seconds = now - self._epoch_start
        if _is_number(logs.get("num_examples")):
            self._epoch_examples = (self._epoch_examples or 0) + int(logs["num_examples"])
        if self.update_freq == "epoch":
            return
        every = int(self.update_freq)
        if self._global_step // every == before // every:
            return
        writer = self._writer("train")
        if writer is None:
            return
        for name, value in logs.items():
            if name not in _HIDDEN and _is_number(value):
                writer.add_scalar(f"batch_{name}", value, self._global_step)
        if self.write_steps_per_second and now > self._batch_start:
            rate = steps / (now - self._batch_start)
            writer.add_scalar("batch_steps_per_second", rate, self._global_step)

    def on_test_end(self, logs: Logs | None = None) -> None:
        if not self._in_fit:
            return
        writer = self._writer("validation")
        if writer is None:
            return
        for name, value in (logs or {}).items():
            if name not in _HIDDEN and _is_number(value):
                writer.add_scalar(f"evaluation_{name}_vs_iterations", value, self._global_step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        model = self.fit_model()
        logs = logs or {}
        train = {k: v for k, v in logs.items() if not k.startswith("val_") and k not in _HIDDEN}
        validation = {k[len("val_") :]: v for k, v in logs.items() if k.startswith("val_")}
        if "learning_rate" not in train:
            train["learning_rate"] = model.learning_rate
        if self.write_steps_per_second and self._train_seconds > 0:
            train["steps_per_second"] = self._epoch_steps / self._train_seconds
            if self._epoch_examples is not None:
                train["examples_per_second"] = self._epoch_examples / self._train_seconds
        writer = self._writer("train")
        if writer is None:
            return
        for name, value in train.items():
            if _is_number(value):
                writer.add_scalar(f"epoch_{name}", value, epoch)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            for name, value in model.state_dict().items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    writer.add_histogram(name, value.detach().float().cpu(), epoch)
        writer.flush()
        if validation:
            validation_writer = self._writer("validation")
            for name, value in validation.items():
                if _is_number(value):
                    validation_writer.add_scalar(f"epoch_{name}", value, epoch)
            validation_writer.flush()

    # -- resuming ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self._global_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._global_step = int(state["global_step"])
