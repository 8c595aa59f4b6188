"""The stage scheduling rules, in an event simulation with no threads: every stage picks its next
operation with ``next_action``; forwards take 1 time unit, backwards 2."""

from __future__ import annotations

import dataclasses

import pytest

from mirrored.pipeline.schedule import Action, StageState, next_action

FORWARD, BACKWARD = 1, 2


@dataclasses.dataclass
class Simulation:
    orders: list[list[str]]  # per stage: "F0", "B0", ...
    peak_in_flight: list[int]
    makespan: int


def simulate(schedule: str, num_stages: int, num_microbatches: int, backward: bool = True):
    """Micro-batch threads send their input at time 0; each one's loss (and backward) starts as
    soon as its output comes back; with ``backward=False`` a thread finishes there instead.
    A thread that sent its backward waits in ``optimizer.step()`` (idle) while its backward is
    still coming down the stages, as in the real step."""
    states = [
        StageState(schedule, s, num_stages, [0] * num_microbatches, set(), set(), set())
        for s in range(num_stages)
    ]
    for k in range(num_microbatches):
        states[0].waiting_forwards.add((0, k))
    finished: set[int] = set()
    coming: set[int] = set()
    busy: list[tuple[int, Action] | None] = [None] * num_stages
    orders: list[list[str]] = [[] for _ in range(num_stages)]
    peak = [0] * num_stages
    time = 0
    for _ in range(10_000):
        # Completions at this time.
        for s, running in enumerate(busy):
            if running is None or running[0] != time:
                continue
            busy[s] = None
            action = running[1]
            if action.kind == "F":
                if s + 1 < num_stages:
                    states[s + 1].waiting_forwards.add(action.key)
                else:
                    if backward:
                        states[s].waiting_backwards.add(action.key)
                        coming.add(action.key[1])
                    finished.add(action.key[1])
            elif s > 0:
                states[s - 1].waiting_backwards.add(action.key)
            else:
                coming.discard(action.key[1])
        for state in states:
            state.idle = frozenset(finished)
            state.coming = frozenset(coming)
            state.finished = frozenset(finished - coming)
        for s, state in enumerate(states):
            if busy[s] is not None:
                continue
            action = next_action(state)
            if action is None:
                continue
            orders[s].append(f"{action.kind}{action.key[1]}")
            if action.kind == "F":
                state.waiting_forwards.remove(action.key)
                state.forwards_done[action.key[1]] += 1
                if backward:
                    state.in_flight.add(action.key)
                peak[s] = max(peak[s], len(state.in_flight))
                busy[s] = (time + FORWARD, action)
            else:
                state.waiting_backwards.remove(action.key)
                state.in_flight.remove(action.key)
                busy[s] = (time + BACKWARD, action)
        if all(b is None for b in busy) and not any(
            s.waiting_forwards or s.waiting_backwards or s.in_flight for s in states
        ):
            return Simulation(orders, peak, time)
        pending = [b[0] for b in busy if b is not None]
        if not pending:
            raise AssertionError(f"deadlock at time {time}: {states}")
        time = min(pending)
    raise AssertionError("the simulation did not end")


def test_gpipe_runs_every_forward_then_every_backward_in_order():
    result = simulate("gpipe", num_stages=3, num_microbatches=4)
    for order in result.orders:
        assert order == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert result.peak_in_flight == [4, 4, 4]


@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 1), (2, 4), (3, 8), (4, 4), (4, 2)])
def test_1f1b_bounds_the_activations_of_stage_s_by_p_minus_s(num_stages, num_microbatches):
    result = simulate("1f1b", num_stages, num_microbatches)
    for s, peak in enumerate(result.peak_in_flight):
        assert peak == min(num_stages - s, num_microbatches)


def test_1f1b_order_is_the_textbook_one():
    result = simulate("1f1b", num_stages=3, num_microbatches=5)
    assert result.orders[0] == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "B3", "B4"]
    assert result.orders[2] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 2), (3, 4), (4, 8)])
def test_the_bubble_is_the_theoretical_one(schedule, num_stages, num_microbatches):
    result = simulate(schedule, num_stages, num_microbatches)
    work = num_microbatches * (FORWARD + BACKWARD)
    bubble = 1 - work / result.makespan
    assert bubble == pytest.approx((num_stages - 1) / (num_microbatches + num_stages - 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_forward_only_steps_finish(schedule):
    result = simulate(schedule, num_stages=3, num_microbatches=4, backward=False)
    assert all(order == ["F0", "F1", "F2", "F3"] for order in result.orders)


def test_1f1b_runs_ahead_when_the_head_micro_batch_waits_at_a_sync_point():
    # Stage 1 of 2 may hold one micro-batch: with micro-batch 0's thread waiting in an
    # all-reduce for the others (no backward can come), the next forward must still run.
    state = StageState(
        "1f1b", 1, 2, [1, 0], waiting_forwards={(0, 1)}, in_flight={(0, 0)}, idle={0}
    )
    assert next_action(state) == Action("F", (0, 1))
    state.idle = frozenset()
    assert next_action(state) is None


def test_a_stage_drops_activations_whose_backward_cannot_come():
    state = StageState("gpipe", 0, 2, [1, 1], in_flight={(0, 0), (0, 1)}, idle={0, 1}, finished={0})
    assert next_action(state) == Action("drop", (0, 0))


def test_forwards_wait_for_the_micro_batch_whose_turn_it_is():
    # Micro-batch 1's input arrived first; micro-batch 0 is still computing: its turn first.
    state = StageState("gpipe", 0, 2, [0, 0], waiting_forwards={(0, 1)})
    assert next_action(state) is None
    state.idle = frozenset({0})  # micro-batch 0 stopped at a sync point: do not wait for it
    assert next_action(state) == Action("F", (0, 1))
