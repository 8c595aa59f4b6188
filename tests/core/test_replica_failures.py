"""Which replica's error a failed run raises."""

from __future__ import annotations

from mirrored.core.replica_failures import add_note, first_failure
from mirrored.core.replica_meeting import ReplicaAbortedError


def test_the_error_that_aborted_the_run_is_the_first_failure():
    early, late = RuntimeError("early"), RuntimeError("late")
    failures = [(0, late), (1, ReplicaAbortedError("released")), (2, early)]
    assert first_failure(failures, early) == (2, early)


def test_without_the_aborting_error_the_first_real_failure_is_raised():
    error = ValueError("bad")
    failures = [(0, ReplicaAbortedError("released")), (1, error)]
    assert first_failure(failures, None) == (1, error)


def test_replicas_that_were_only_released_have_no_first_failure():
    assert first_failure([(0, ReplicaAbortedError("released"))], None) is None


def test_a_note_is_added_once():
    error = RuntimeError("x")
    add_note(error, "in replica 1")
    add_note(error, "in replica 1")
    assert error.__notes__ == ["in replica 1"]
