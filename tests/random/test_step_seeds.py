"""Step seeds: one draw of the caller's generator per step that needs randomness, taken as the
step ends, and none for a step without random ops."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

import mirrored


def test_a_step_without_random_ops_leaves_the_callers_random_stream_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(3)
        strategy.run(lambda: torch.ones(3) * 2)
        assert torch.equal(torch.rand(4), expected)


def test_draws_from_the_caller_s_generator_during_a_step_are_kept():
    """A prefetching input's augmentations draw from the global generator while replicas run:
    the next step does not draw the same numbers again."""
    torch.manual_seed(8)
    expected = []
    for _ in range(2):
        expected.append(torch.rand(4))
        torch.empty((), dtype=torch.int64).random_()  # the step's seed
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(8)

        def step():
            F.dropout(torch.ones(8), 0.5, True)
            if mirrored.get_replica_context().replica_id_in_sync_group == 0:
                return torch.rand(4, generator=torch.default_generator)
            return None

        drawn = [strategy.experimental_local_results(strategy.run(step))[0] for _ in range(2)]
    assert all(torch.equal(d, e) for d, e in zip(drawn, expected, strict=True))


def test_strategies_stepping_at_once_draw_streams_of_their_own():
    torch.manual_seed(0)
    meet = threading.Barrier(2)
    drawn = {}

    def step():
        if mirrored.get_replica_context().replica_id_in_sync_group == 0:
            meet.wait(timeout=30)  # both steps have begun before either claims its seed
        return torch.rand(4)

    def train(name, strategy):
        drawn[name] = strategy.experimental_local_results(strategy.run(step))

    with (
        mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as a,
        mirrored.MirroredStrategy(["cpu:2", "cpu:3"]) as b,
    ):
        threads = [threading.Thread(target=train, args=item) for item in (("a", a), ("b", b))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    after = torch.get_rng_state()
    assert len({tuple(t.tolist()) for t in (*drawn["a"], *drawn["b"])}) == 4
    torch.manual_seed(0)
    torch.empty(2, dtype=torch.int64).random_()  # one draw for each step's seed
    assert torch.equal(after, torch.get_rng_state())


def test_the_caller_s_generator_is_left_alone_while_replicas_run_and_takes_one_draw_after():
    """Replicas read the step's seed from a copy: torch's own saves and restores of the global
    generator in replica threads (checkpoint's preserve_rng_state) cannot undo the draw."""
    torch.manual_seed(8)
    before = torch.get_rng_state()
    torch.empty((), dtype=torch.int64).random_()
    after_one_draw = torch.get_rng_state()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(8)

        def step():
            F.dropout(torch.ones(8), 0.5, True)
            return torch.equal(torch.get_rng_state(), before)

        assert all(strategy.experimental_local_results(strategy.run(step)))
        assert torch.equal(torch.get_rng_state(), after_one_draw)
