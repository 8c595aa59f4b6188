"""Which stack level a warning names: the first frame outside mirrored, so that a warning raised
deep inside the library (a mirrored optimizer's plan, made by ``strategy.mirror`` or
``Model.compile``) points at the user's line whichever way it was reached."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["user_stacklevel"]

_PACKAGE = str(Path(__file__).resolve().parents[1])


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called where this is called."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level
