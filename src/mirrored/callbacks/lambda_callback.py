"""``LambdaCallback``: a callback made of plain functions, for one-off needs (Keras's).

Each hook given by name is called as the method would be, always with a logs dict:
``on_epoch_end(epoch, logs)``, ``on_train_begin(logs)``, ``on_train_batch_end(batch, logs)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mirrored.callbacks.callback import Callback, Logs

__all__ = ["LambdaCallback"]

HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))


class LambdaCallback(Callback):
    """Call the functions given for the hooks of the same names; the others do nothing.

    ``LambdaCallback(on_epoch_end=lambda epoch, logs: print(epoch, logs["loss"]))``. Any hook of
    ``Callback`` may be given by keyword (``on_test_end=...``, ``on_predict_batch_end=...``).
    """

    def __init__(
        self,
        on_epoch_begin: Callable[[int, Logs], Any] | None = None,
        on_epoch_end: Callable[[int, Logs], Any] | None = None,
        on_train_begin: Callable[[Logs], Any] | None = None,
        on_train_end: Callable[[Logs], Any] | None = None,
        on_train_batch_begin: Callable[[int, Logs], Any] | None = None,
        on_train_batch_end: Callable[[int, Logs], Any] | None = None,
        **other_hooks: Callable[..., Any] | None,
    ) -> None:
        super().__init__()
        unknown = sorted(set(other_hooks) - set(HOOKS))
        if unknown:
            raise TypeError(
                f"LambdaCallback got unknown hooks {unknown}; the hooks are {list(HOOKS)}"
            )
        given = {
            "on_epoch_begin": on_epoch_begin,
            "on_epoch_end": on_epoch_end,
            "on_train_begin": on_train_begin,
            "on_train_end": on_train_end,
            "on_train_batch_begin": on_train_batch_begin,
            "on_train_batch_end": on_train_batch_end,
            **other_hooks,
        }
        for name, function in given.items():
            if function is not None and not callable(function):
                raise TypeError(f"LambdaCallback: {name}={function!r} is not callable")
        self.functions: dict[str, Callable[..., Any]] = {
            name: function for name, function in given.items() if function is not None
        }

    def reads_batch_logs(self, hook: str) -> bool:
        return hook in self.functions


def _dispatch(hook: str, takes_index: bool) -> Any:
    if takes_index:

        def call_indexed(self: LambdaCallback, index: int, logs: Logs | None = None) -> None:
            function = self.functions.get(hook)
            if function is not None:
                function(index, {} if logs is None else logs)

        call_indexed.__name__ = hook
        return call_indexed

    def call(self: LambdaCallback, logs: Logs | None = None) -> None:
        function = self.functions.get(hook)
        if function is not None:
            function({} if logs is None else logs)

    call.__name__ = hook
    return call


for _hook in HOOKS:
    _takes_index = _hook.endswith(("_batch_begin", "_batch_end")) or _hook in (
        "on_epoch_begin",
        "on_epoch_end",
    )
    setattr(LambdaCallback, _hook, _dispatch(_hook, _takes_index))
