"""What a test asks of a traced step."""

from __future__ import annotations

from typing import Any


def replays(step: Any) -> bool:
    """The step traced on every call signature, never ran as written, and TorchScript runs
    every piece of its traces."""
    traces = [
        trace
        for replicas in step._replicas.values()
        for state in replicas.values()
        for trace in state.traces.values()
    ]
    return bool(traces) and all(getattr(trace, "scripted", False) for trace in traces)
