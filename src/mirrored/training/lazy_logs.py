"""Batch logs that are computed the first time a callback reads them.

A batch's logs are the running loss and metrics as floats: reading them copies the metric sums
to the host, which waits for the device to finish the step. Most steps have no reader (``fit``
with ``verbose=0``, a timing callback, a checkpoint that is not due), so ``fit`` hands the
callbacks a ``LazyLogs`` instead: a ``dict`` that fills itself on first use, from a snapshot of
the sums taken at that batch, so that logs kept and read later still hold that batch's values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LazyLogs"]

# Every dict method that reads or changes the contents: each fills the logs first.
_CONTENT_METHODS = (
    "__contains__",
    "__delitem__",
    "__eq__",
    "__getitem__",
    "__ior__",
    "__iter__",
    "__len__",
    "__ne__",
    "__or__",
    "__repr__",
    "__reversed__",
    "__ror__",
    "__setitem__",
    "clear",
    "copy",
    "get",
    "items",
    "keys",
    "pop",
    "popitem",
    "setdefault",
    "update",
    "values",
)


class LazyLogs(dict[str, Any]):
    """A ``dict`` whose contents come from ``compute()``, called once, on first use."""

    __slots__ = ("_compute",)

    def __init__(self, compute: Callable[[], dict[str, Any]]) -> None:
        super().__init__()
        self._compute: Callable[[], dict[str, Any]] | None = compute

    def _filled(self) -> LazyLogs:
        compute, self._compute = self._compute, None
        if compute is not None:
            dict.update(self, compute())
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # copy and pickle: a plain dict of the values
        return dict, (dict(self._filled()),)

    __hash__ = None


def _filling(name: str) -> Callable[..., Any]:
    method = getattr(dict, name)

    def filled_first(self: LazyLogs, *args: Any, **kwargs: Any) -> Any:
        return method(self._filled(), *args, **kwargs)

    filled_first.__name__ = name
    return filled_first


for _name in _CONTENT_METHODS:
    setattr(LazyLogs, _name, _filling(_name))
