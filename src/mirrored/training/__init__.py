"""The Keras-style training front-end: ``mirrored.Model`` and what its loops are made of."""

from __future__ import annotations

from mirrored.training.model import Model

__all__ = ["Model"]
