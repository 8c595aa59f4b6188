"""Keras-named optimizers (``Adam``, ``AdamW``, ``SGD``, ``RMSprop``) and learning-rate
``schedules`` for ``mirrored.Model.compile``; each builds the matching torch optimizer
(``decoupled`` holds torch's SGD and RMSprop with Keras's decoupled weight decay)."""

from __future__ import annotations

from mirrored.optimizers import decoupled, schedules
from mirrored.optimizers.optimizer import SGD, Adam, AdamW, Optimizer, RMSprop, get

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "RMSprop", "decoupled", "get", "schedules"]
