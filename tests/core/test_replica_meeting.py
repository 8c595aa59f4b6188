"""Failures never hang: errors are raised in the caller naming the replica, others released."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

import mirrored
from mirrored.core.replica_meeting import (
    ReplicaAbortedError,
    ReplicaMeeting,
    SyncMismatchError,
    SyncTimeoutError,
)
from mirrored.core.replica_workers import ReplicaWorkers


def _in_threads(num_replicas, body):
    """Run body(replica_id) on threads; return each outcome (value or exception)."""
    outcomes = [None] * num_replicas

    def target(replica_id):
        try:
            outcomes[replica_id] = body(replica_id)
        except BaseException as error:
            outcomes[replica_id] = error

    threads = [threading.Thread(target=target, args=(i,)) for i in range(num_replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a replica hung"
    return outcomes


def test_exchange_returns_every_value_in_replica_order():
    meeting = ReplicaMeeting(3, timeout_seconds=10)
    outcomes = _in_threads(3, lambda i: [meeting.exchange(i, "x", i * 10) for _ in range(5)])
    assert outcomes == [[[0, 10, 20]] * 5] * 3


def test_different_labels_are_a_mismatch_for_everyone():
    meeting = ReplicaMeeting(2, timeout_seconds=10)
    outcomes = _in_threads(2, lambda i: meeting.exchange(i, f"point-{i}", None))
    assert all(isinstance(o, ReplicaAbortedError) for o in outcomes)
    assert isinstance(meeting.abort_reason, SyncMismatchError)
    assert "replica 0 at 'point-0'" in str(meeting.abort_reason)


def test_a_replica_that_returns_early_releases_the_waiting_one():
    meeting = ReplicaMeeting(2, timeout_seconds=10)

    def body(replica_id):
        try:
            if replica_id == 1:
                time.sleep(0.05)
                return "done"
            return meeting.exchange(replica_id, "optimizer.step", None)
        finally:
            meeting.finish(replica_id)

    outcomes = _in_threads(2, body)
    assert isinstance(outcomes[0], ReplicaAbortedError) and outcomes[1] == "done"
    assert "replica 0 waits at sync point 'optimizer.step'" in str(meeting.abort_reason)


def test_an_exchange_completed_before_an_abort_returns_its_values():
    # Replica 1 completes the exchange and fails before replica 0 leaves its wait (it holds
    # the meeting' lock until then): replica 0 has its values, and is released at its next
    # sync point, as if it had left the wait first.
    meeting = ReplicaMeeting(2, timeout_seconds=10)

    def body(replica_id):
        if replica_id == 0:
            values = meeting.exchange(0, "x", "zero")
            with pytest.raises(ReplicaAbortedError):
                meeting.exchange(0, "y", None)
            return values
        while meeting.waiting() != {0: "x"}:
            time.sleep(0.001)
        with meeting._cond:  # keeps replica 0 in its wait until the abort
            values = meeting.exchange(1, "x", "one")
            meeting.abort(RuntimeError("replica 1 failed"))
        return values

    assert _in_threads(2, body) == [["zero", "one"]] * 2


def test_a_missing_replica_times_out_with_its_id():
    meeting = ReplicaMeeting(3, timeout_seconds=0.2)
    outcomes = _in_threads(3, lambda i: None if i == 2 else meeting.exchange(i, "x", i))
    assert isinstance(meeting.abort_reason, SyncTimeoutError)
    assert "replica(s) [2] did not reach sync point 'x'" in str(meeting.abort_reason)
    assert outcomes[2] is None


def test_exception_in_one_replica_is_raised_with_its_id_and_releases_the_others():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:

        def fn():
            replica = mirrored.get_replica_context()
            if replica.replica_id_in_sync_group == 1:
                raise KeyError("boom")
            return replica.all_reduce("sum", torch.ones(1))  # the others wait here

        with pytest.raises(KeyError, match="boom") as info:
            strategy.run(fn)
        assert "raised in replica 1 of 3 (device cpu:1)" in info.value.__notes__
        assert any(frame.name == "fn" for frame in info.traceback)  # the original traceback
        # The strategy stays usable.
        assert strategy.reduce("sum", strategy.run(lambda: torch.ones(1)), axis=None).item() == 3


def test_replicas_making_different_numbers_of_sync_calls_get_an_error():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=30) as strategy:

        def fn():
            replica = mirrored.get_replica_context()
            for _ in range(1 + replica.replica_id_in_sync_group):
                replica.all_reduce("sum", torch.ones(1))

        started = time.monotonic()
        with pytest.raises(SyncMismatchError, match="every replica must make the same sync"):
            strategy.run(fn)
        assert time.monotonic() - started < 10


def test_an_optimizer_step_on_only_some_replicas_is_an_error():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, optimizer = _mirror_linear(strategy)

        def fn():
            model(torch.ones(1, 2)).sum().backward()
            if mirrored.get_replica_context().replica_id_in_sync_group == 0:
                optimizer.step()

        with pytest.raises(SyncMismatchError, match=r"optimizer\.step"):
            strategy.run(fn)


def _mirror_linear(strategy):
    module = torch.nn.Linear(2, 1)
    return strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))


# Generous for a loaded 2-core machine: the point is that the wait is not repeated (it used to
# come after three times the timeout).
_MARGIN_SECONDS = 3.0


def _stuck_replica_1(release, sync_point):
    def fn():
        replica = mirrored.get_replica_context()
        if replica.replica_id_in_sync_group == 1 and not release.is_set():
            release.wait(60)
        if sync_point:
            return replica.all_reduce("sum", torch.ones(1))
        return None

    return fn


@pytest.mark.parametrize(
    ("sync_point", "message"),
    [
        (True, r"replica\(s\) \[1\] did not reach sync point 'all_reduce' within 2 s"),
        (False, r"replica\(s\) \[1\] on \['cpu:1'\] did not finish within 2 s of the others"),
    ],
)
def test_a_stuck_replica_fails_the_run_within_the_timeout_then_the_strategy_runs_again(
    sync_point, message
):
    release = threading.Event()
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=2)
    try:
        fn = _stuck_replica_1(release, sync_point)
        started = time.monotonic()
        with pytest.raises(SyncTimeoutError, match=message):
            strategy.run(fn)
        assert time.monotonic() - started < 2 + _MARGIN_SECONDS
        release.set()
        result = strategy.run(fn)
        if sync_point:
            assert strategy.reduce("sum", result, axis=None).item() == 4
    finally:
        release.set()
        strategy.close()


def test_a_run_waits_for_a_replica_still_stuck_in_an_earlier_run_then_names_it():
    release = threading.Event()
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=0.5)
    try:
        fn = _stuck_replica_1(release, sync_point=False)
        with pytest.raises(SyncTimeoutError, match="did not finish"):
            strategy.run(fn)
        with pytest.raises(SyncTimeoutError, match=r"\['cpu:1'\] are still running .* earlier run"):
            strategy.run(lambda: None)
        threading.Timer(0.1, release.set).start()  # returns while the next run waits for it
        strategy.run(fn)
    finally:
        release.set()
        strategy.close()


def test_replicas_a_stuck_replica_changed_late_are_resynced_before_the_next_run():
    release = threading.Event()
    returned = threading.Event()
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=0.5)
    try:
        model = strategy.mirror(torch.nn.Linear(2, 1))

        def late_update():
            replica = mirrored.get_replica_context()
            if replica.replica_id_in_sync_group == 1:
                release.wait(60)
                with torch.no_grad():
                    model.weight.add_(1.0)  # what a replica finishing its step late does
                returned.set()

        with pytest.raises(SyncTimeoutError, match="did not finish"):
            strategy.run(late_update)
        release.set()
        assert returned.wait(10)
        weights = strategy.run(lambda: model.weight.detach().clone())
        first, second = strategy.experimental_local_results(weights)
        assert torch.equal(first, second)
        assert torch.equal(first, model.replicas[0].weight)
    finally:
        release.set()
        strategy.close()


def test_the_run_after_stragglers_returned_calls_after_stragglers_once_before_its_tasks():
    release = threading.Event()
    workers = ReplicaWorkers(["cpu:0", "cpu:1"])
    calls = []
    try:
        with pytest.raises(SyncTimeoutError, match="did not finish"):
            workers.run([lambda: "0", release.wait], 0.2, lambda reason: None)
        assert workers.broken is not None and "cpu:1" in workers.broken
        release.set()
        outcomes = workers.run(
            [lambda: calls.append("task")] * 2,
            5,
            lambda reason: None,
            lambda: calls.append("after"),
        )
        assert outcomes == [(True, None)] * 2
        workers.run([lambda: None] * 2, 5, lambda reason: None, lambda: calls.append("after"))
        assert calls == ["after", "task", "task"] and workers.broken is None
    finally:
        release.set()
        workers.close()


def test_close_stops_threads_and_run_after_close_is_an_error():
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    names = {t.name for t in threading.enumerate() if t.name.startswith("mirrored-replica-")}
    # Replica 0 runs on the caller's thread; the others have workers.
    assert names == {"mirrored-replica-1-cpu:1", "mirrored-replica-2-cpu:2"}
    caller = threading.get_ident()
    ids = strategy.run(lambda: threading.get_ident())
    assert ids.values[0] == caller and caller not in ids.values[1:]
    strategy.close()
    strategy.close()  # idempotent
    assert not [t for t in threading.enumerate() if t.name.startswith("mirrored-replica-")]
    with pytest.raises(RuntimeError, match="closed"):
        strategy.run(lambda: None)


def test_threads_end_when_an_unclosed_strategy_is_collected():
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"])
    strategy.run(lambda: None)
    del strategy  # the autouse hygiene fixture checks that no replica thread survives


def test_run_inside_a_replica_function_is_an_error_not_a_deadlock():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with pytest.raises(RuntimeError, match="inside a replica function"):
            strategy.run(lambda: strategy.run(lambda: None))

        def merge():
            replica = mirrored.get_replica_context()
            return replica.merge_call(lambda s: s.run(lambda: None))

        with pytest.raises(RuntimeError, match="inside a replica function"):
            strategy.run(merge)
        assert strategy.run(lambda: 1) == 1


def test_runs_from_two_caller_threads_do_not_interleave():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        results = {}

        def caller(tag):
            results[tag] = [
                strategy.experimental_local_results(
                    strategy.run(
                        lambda: (
                            tag,
                            mirrored.get_replica_context().all_reduce("sum", torch.ones(1)).item(),
                        )
                    )
                )
                for _ in range(20)
            ]

        threads = [threading.Thread(target=caller, args=(tag,)) for tag in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert results["a"] == [(("a", 2.0), ("a", 2.0))] * 20
        assert results["b"] == [(("b", 2.0), ("b", 2.0))] * 20


@pytest.fixture
def python_ctrl_c():
    """Python's own SIGINT handler for the test's length.

    A Python started in the background by a shell without job control (`cmd &`, nohup, many CI
    runners) inherits SIGINT ignored and keeps it so; Ctrl-C then never becomes KeyboardInterrupt.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_replicas_run_releases_them_and_keeps_the_strategy_usable(python_ctrl_c):
    # Python runs signal handlers on the main thread, where replica 0 runs: raise_signal sends
    # SIGINT to this very thread.
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=30) as strategy:

        def fn():
            replica = mirrored.get_replica_context()
            if replica.replica_id_in_sync_group == 0:
                signal.raise_signal(signal.SIGINT)  # as Ctrl-C would, while replica 1 waits
            replica.all_reduce("sum", torch.ones(1))

        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            strategy.run(fn)
        assert time.monotonic() - started < 10
        assert strategy.reduce("sum", strategy.run(lambda: torch.ones(1)), axis=None).item() == 2


def test_an_unclosed_strategy_is_collected_after_a_failed_run():
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"])

    def fn():
        if mirrored.get_replica_context().replica_id_in_sync_group == 1:
            raise ValueError("boom")

    with pytest.raises(ValueError):
        strategy.run(fn)
    del strategy  # the hygiene fixture checks that the worker thread ended


def test_close_does_not_hang_on_a_stuck_replica():
    release = threading.Event()
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=0.2)
    try:
        with pytest.raises(SyncTimeoutError):
            strategy.run(
                lambda: (
                    release.wait(30)
                    if mirrored.get_replica_context().replica_id_in_sync_group
                    else None
                )
            )
        started = time.monotonic()
        strategy.close()
        assert time.monotonic() - started < 2
    finally:
        release.set()


@pytest.mark.parametrize("ops", [mirrored.HierarchicalCopyAllReduce, mirrored.ReductionToOneDevice])
def test_replicas_are_resynced_after_a_step_that_failed_on_one_replica(ops):
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], ops()) as strategy:
        module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
        model, mirrored_optimizer = strategy.mirror(module, optimizer)
        fail = {"once": True}

        def fail_on_replica_1(opt, args, kwargs):
            if opt is not optimizer and fail.pop("once", False):
                raise MemoryError("simulated out-of-memory in replica 1's update")

        for replica_optimizer in mirrored_optimizer.optimizers:
            replica_optimizer.register_step_pre_hook(fail_on_replica_1)

        def step():
            model(torch.ones(4, 3)).sum().backward()
            mirrored_optimizer.step()
            mirrored_optimizer.zero_grad()

        with pytest.raises(MemoryError):
            strategy.run(step)
        first, second = (list(r.parameters()) for r in model.replicas)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        strategy.run(step)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_failing_resync_never_hides_the_original_error():
    class WithExtraState(torch.nn.Linear):
        def get_extra_state(self):
            return {"note": "not a tensor"}

        def set_extra_state(self, state):
            pass

    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model = strategy.mirror(WithExtraState(2, 2))

        def fn():
            model(torch.ones(1, 2))
            if mirrored.get_replica_context().replica_id_in_sync_group == 1:
                raise ValueError("the real error")

        with pytest.raises(ValueError, match="the real error"):
            strategy.run(fn)


def test_close_inside_a_replica_function_is_an_error_not_a_hang():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with pytest.raises(RuntimeError, match="inside a replica function"):
            strategy.run(strategy.close)
        assert strategy.run(lambda: 1) == 1
