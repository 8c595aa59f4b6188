"""Argument checks shared by the optimizer specs and the schedules.

Each names the class, the argument and the value received, and says what is expected, so that a
typo in a hyperparameter fails where it is written, not as a NaN loss a thousand steps later.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["boolean", "fraction", "non_negative", "positive", "real"]


def real(owner: str, name: str, value: Any) -> float:
    """``value`` as a finite float; bools, strings and tensors are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name}={value!r} is a {type(value).__name__}; expected a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{owner}: {name}={value!r}; expected a finite number")
    return number


def non_negative(owner: str, name: str, value: Any) -> float:
    number = real(owner, name, value)
    if number < 0:
        raise ValueError(f"{owner}: {name}={value!r}; expected a number >= 0")
    return number


def positive(owner: str, name: str, value: Any) -> float:
    number = real(owner, name, value)
    if number <= 0:
        raise ValueError(f"{owner}: {name}={value!r}; expected a number > 0")
    return number


def fraction(owner: str, name: str, value: Any, *, include_one: bool = False) -> float:
    """A number in [0, 1), or [0, 1] with ``include_one``."""
    number = real(owner, name, value)
    if number < 0 or number > 1 or (number == 1 and not include_one):
        interval = "[0, 1]" if include_one else "[0, 1)"
        raise ValueError(f"{owner}: {name}={value!r}; expected a number in {interval}")
    return number


def boolean(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name}={value!r}; expected True or False")
    return value
