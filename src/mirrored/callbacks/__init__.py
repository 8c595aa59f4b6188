"""Keras's callbacks for ``mirrored.Model.fit`` (one per file, Keras's hook names)."""

from __future__ import annotations

from mirrored.callbacks.backup_and_restore import BackupAndRestore
from mirrored.callbacks.callback import Callback, CallbackList
from mirrored.callbacks.csv_logger import CSVLogger
from mirrored.callbacks.early_stopping import EarlyStopping
from mirrored.callbacks.history import History
from mirrored.callbacks.lambda_callback import LambdaCallback
from mirrored.callbacks.learning_rate_scheduler import LearningRateScheduler
from mirrored.callbacks.model_checkpoint import ModelCheckpoint
from mirrored.callbacks.progbar_logger import ProgbarLogger
from mirrored.callbacks.tensorboard import TensorBoard
from mirrored.callbacks.terminate_on_nan import TerminateOnNaN

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgbarLogger",
    "TensorBoard",
    "TerminateOnNaN",
]
