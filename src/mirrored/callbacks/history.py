"""``History``: every epoch's logs, returned by ``fit`` (Keras's ``model.history``)."""

from __future__ import annotations

from typing import Any

from mirrored.callbacks.callback import Callback, Logs

__all__ = ["History"]


class History(Callback):
    """``history.history[name]`` lists a log's value per epoch; ``history.epoch`` the epochs."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(value)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": list(self.epoch), "history": {k: list(v) for k, v in self.history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = list(state["epoch"])
        self.history = {k: list(v) for k, v in state["history"].items()}
