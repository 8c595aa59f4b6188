"""The callback base class and the list that calls every callback in order (Keras's hooks).

``fit``, ``evaluate`` and ``predict`` call the hooks of a ``CallbackList``; each hook is a no-op
here, so a callback overrides only the ones it needs. ``self.model`` is the ``mirrored.Model``
being trained (what callbacks use of it: ``FitState``) and ``self.params`` holds ``epochs``,
``steps`` (per epoch, None when unknown) and ``verbose``. Logs are dicts of floats: the running
means of the epoch at batch ends, the epoch's results (``val_`` prefixed for validation) at
epoch ends.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mirrored.core.strategy import Strategy

__all__ = ["Callback", "CallbackList", "FitPosition", "FitState"]

Logs = dict[str, Any]
# Where a fit is: (epoch, batches done in it, batches consumed from an iterator), the random
# state of the epoch's start, and the epoch's running metrics.
FitPosition = tuple[dict[str, Any], dict[str, Any] | None, list[Any]]


class FitState(Protocol):
    """The model a callback is given (``self.model``), as the callbacks use it; a
    ``mirrored.Model`` is one. Declared beside the callbacks, so that they depend on no part of
    the training loop that calls them."""

    strategy: Strategy
    stop_training: bool

    @property
    def learning_rate(self) -> float: ...
    @learning_rate.setter
    def learning_rate(self, value: float) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
    def training_state(self) -> dict[str, Any]: ...
    def load_training_state(self, state: dict[str, Any], source: str = ...) -> None: ...
    def save(self, filepath: str | Path, allow_non_finite: bool = ...) -> None: ...
    def save_weights(self, filepath: str | Path, allow_non_finite: bool = ...) -> None: ...

    # For ``BackupAndRestore``, while fit runs.
    def callbacks_in_fit(self) -> list[Callback]: ...
    def preemption_requested(self) -> bool: ...
    def fit_position(self) -> FitPosition: ...
    def resume_fit(
        self,
        progress: dict[str, Any],
        rng: dict[str, Any],
        epoch_rng: dict[str, Any] | None,
        metrics: list[Any],
    ) -> None: ...


class Callback:
    """Base class: override the hooks you need. ``state_dict`` / ``load_state_dict`` carry the
    callback's progress (a patience counter, a best value) through ``BackupAndRestore``."""

    def __init__(self) -> None:
        self.model: FitState | None = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: FitState) -> None:
        self.model = model

    def fit_model(self) -> FitState:
        """The model being fit; a RuntimeError for a callback used outside ``fit``."""
        if self.model is None:
            raise RuntimeError(
                f"{type(self).__name__} has no model; pass it to model.fit(callbacks=[...])"
            )
        return self.model

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

    def set_model(self, model: FitState) -> None:
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
