"""The callback base class and the list that calls every callback in order (Keras's hooks).

``fit``, ``evaluate`` and ``predict`` call the hooks of a ``CallbackList``; each hook is a no-op
here, so a callback overrides only the ones it needs. ``self.model`` is the ``mirrored.Model``
being trained and ``self.params`` holds ``epochs``, ``steps`` (per epoch, None when unknown) and
``verbose``. Logs are dicts of floats: the running means of the epoch at batch ends, the epoch's
results (``val_`` prefixed for validation) at epoch ends.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mirrored.training.model import Model

__all__ = ["Callback", "CallbackList"]

Logs = dict[str, Any]


class Callback:
    """Base class: override the hooks you need. ``state_dict`` / ``load_state_dict`` carry the
    callback's progress (a patience counter, a best value) through ``BackupAndRestore``."""

    def __init__(self) -> None:
        self.model: Model | None = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Model) -> None:
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    def reads_batch_logs(self, hook: str) -> bool:
        """Whether this callback's ``hook`` (``"on_train_batch_end"`` or ``"on_test_batch_end"``)
        reads the loss and metrics in its logs. Those cost a host copy of the metrics, which
        waits for the device to finish the step, so fit and evaluate compute them only when a
        callback reads them; otherwise the hook gets ``{"num_examples": n}`` (training) or
        ``{}``. By default a callback reads them when it overrides ``hook``; one that overrides
        it only to time or count steps returns False here."""
        return getattr(type(self), hook) is not getattr(Callback, hook)

    def state_dict(self) -> dict[str, Any]:
        """What this callback must remember across a restart (empty: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def on_train_begin(self, logs: Logs | None = None) -> None: ...
    def on_train_end(self, logs: Logs | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_begin(self, logs: Logs | None = None) -> None: ...
    def on_test_end(self, logs: Logs | None = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_begin(self, logs: Logs | None = None) -> None: ...
    def on_predict_end(self, logs: Logs | None = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...


_HOOKS = [name for name in vars(Callback) if name.startswith("on_")]


class CallbackList(Callback):
    """Calls each hook on every callback, in the order given."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        super().__init__()
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(
                    f"callbacks must be mirrored.callbacks.Callback instances; got "
                    f"{type(callback).__name__} (wrap a function in LambdaCallback)"
                )

    def set_model(self, model: Model) -> None:
        super().set_model(model)
        for callback in self.callbacks:
            callback.set_model(model)

    def set_params(self, params: dict[str, Any]) -> None:
        super().set_params(params)
        for callback in self.callbacks:
            callback.set_params(params)

    def reads_batch_logs(self, hook: str) -> bool:
        return any(callback.reads_batch_logs(hook) for callback in self.callbacks)


def _fan_out(hook: str) -> Any:
    def call_all(self: CallbackList, *args: Any, **kwargs: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args, **kwargs)

    call_all.__name__ = hook
    call_all.__doc__ = f"``{hook}`` of every callback, in order."
    return call_all


for _hook in _HOOKS:
    setattr(CallbackList, _hook, _fan_out(_hook))
