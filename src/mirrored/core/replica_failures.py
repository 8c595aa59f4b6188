"""How a failed run is reported: which replica's error the caller gets, and notes on it.

When one replica fails, the meeting releases the others with ``ReplicaAbortedError``; the
caller must get the error that started it, not one of the releases.
"""

from __future__ import annotations

from mirrored.core.replica_meeting import ReplicaAbortedError

__all__ = ["add_note", "first_failure"]


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``, on Python 3.10 too, once."""
    notes: list[str] = getattr(error, "__notes__", [])
    if note not in notes:
        error.__notes__ = [*notes, note]  # type: ignore[attr-defined]


def first_failure(
    failures: list[tuple[int, BaseException]], abort_reason: BaseException | None
) -> tuple[int, BaseException] | None:
    """The (replica, error) that failed first: the one whose error aborted the run, else the
    first real failure; None when every failure is a release of a replica."""
    real = [(i, e) for i, e in failures if not isinstance(e, ReplicaAbortedError)]
    if not real:
        return None
    return next(((i, e) for i, e in real if e is abort_reason), real[0])
