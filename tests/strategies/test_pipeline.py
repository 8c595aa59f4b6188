"""PipelineStrategy on logical CPU devices: the parameters of the plain single-device loop, for
GPipe and 1F1B, with and without recomputation, data parallel over pipelines, with fit; bad input
refused before any compute; no hang on steps that are not forward-then-backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_norm_

import mirrored
from mirrored.pipeline.split import StageShapeError
from tests.exactness import assert_close_float64
from tests.reference_loops import (
    OPTIMIZERS,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

THREE = ["cpu:0", "cpu:1", "cpu:2"]


def _pipeline(**kwargs) -> mirrored.PipelineStrategy:
    kwargs.setdefault("devices", THREE)
    kwargs.setdefault("timeout_seconds", 60)
    return mirrored.PipelineStrategy(**kwargs)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_equals_the_plain_loop(schedule, recompute, optimizer):
    batches = make_batches()  # 203 examples: the last batch (11) is ragged over 4 micro-batches
    expected = make_mlp()
    plain_losses = train_plain(expected, OPTIMIZERS[optimizer](expected), batches)
    net = make_mlp()
    with _pipeline(num_microbatches=4, schedule=schedule, recompute=recompute) as strategy:
        model, _, losses = train_mirrored(strategy, net, OPTIMIZERS[optimizer](net), batches)
        timelines = strategy.stage_timelines()
    assert_same_parameters(expected, net)
    assert_close_float64(losses, plain_losses)
    assert model.module is net
    # The last run (the ragged batch) ran 4 forwards and 4 backwards on each of the 3 stages.
    assert [[len(stage.ops) for stage in pipeline] for pipeline in timelines] == [[8, 8, 8]]


def test_two_pipelines_of_two_stages_equal_one_device():
    batches = make_batches()
    expected = make_mlp()
    train_plain(expected, OPTIMIZERS["adam"](expected), batches)
    net = make_mlp()
    strategy = _pipeline(
        devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], num_microbatches=2, num_pipelines=2
    )
    with strategy:
        assert strategy.num_replicas_in_sync == 4
        model, optimizer, _ = train_mirrored(strategy, net, OPTIMIZERS["adam"](net), batches)
    assert_same_parameters(expected, net)
    assert_replicas_identical(model)
    assert len(optimizer.optimizers) == 2


def test_stages_given_as_modules_and_as_split_points():
    batches = make_batches(num_examples=64)
    expected = make_mlp()
    train_plain(expected, OPTIMIZERS["sgd"](expected), batches)
    for split in ([2, 4], "modules"):
        net = make_mlp()
        with _pipeline(split=[2, 4] if split != "modules" else "parameters") as strategy:
            module = [net[0:2], net[2:4], net[4:]] if split == "modules" else net
            model, optimizer = strategy.mirror(module, OPTIMIZERS["sgd"](net))
            for batch in strategy.experimental_distribute_dataset(batches):
                strategy.run(_train_step(model, optimizer), args=(batch,))
            state = model.state_dict()
        plain = nn.Sequential(*module) if split == "modules" else expected
        assert list(state) == list(plain.state_dict())
        assert_same_parameters(expected, net)


def test_balance_by_time_and_by_parameters_give_valid_splits():
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    points = mirrored.balance_by_time(net, torch.randn(4, 16), num_stages=3, repeats=1)
    assert len(points) == 2 and 0 < points[0] < points[1] < 6
    with _pipeline() as strategy:
        strategy.mirror(net)
        ranges = strategy._layer_ranges
    assert ranges == [(0, 2), (2, 4), (4, 6)]  # equal parameter counts: two layers each


@pytest.mark.float32  # counts float32 bytes
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_activation_memory_per_stage_follows_the_schedule(schedule):
    # Three equal stages, 8 equal micro-batches: a micro-batch keeps the stage input (which the
    # Linear saves too: counted once) and the ReLU's output, 8 x 32 floats each, at every stage.
    per_microbatch = 2 * 8 * 32 * 4
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)]
    optimizer = torch.optim.SGD([p for stage in stages for p in stage.parameters()], lr=0.1)
    batches = [(torch.randn(64, 32), torch.randint(0, 32, (64,))) for _ in range(3)]
    with _pipeline(num_microbatches=8, schedule=schedule) as strategy:
        model, optimizer = strategy.mirror(stages, optimizer)
        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(_train_step(model, optimizer), args=(batch,))
            (timelines,) = strategy.stage_timelines()
            for s, timeline in enumerate(timelines):
                bound = 8 if schedule == "gpipe" else 3 - s
                held = peak = 0
                for op in sorted(timeline.ops, key=lambda op: op.start):
                    held += 1 if op.kind == "F" else -1
                    peak = max(peak, held)
                assert peak <= bound, f"stage {s} held {peak} micro-batches, bound {bound}"
                assert timeline.peak_activation_bytes <= bound * per_microbatch
                if schedule == "gpipe" or s == 2:  # these always reach their bound
                    assert timeline.peak_activation_bytes == bound * per_microbatch


def _train_step(model, optimizer):
    def step(batch):
        x, y = batch
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def test_gradients_without_a_step_reach_param_grad_at_the_end_of_the_run():
    (x, y), *_ = make_batches(num_examples=16)
    expected = make_mlp()
    F.cross_entropy(expected(x), y).backward()
    F.cross_entropy(expected(x), y).backward()  # accumulated over two runs
    net = make_mlp()
    with _pipeline(schedule="1f1b") as strategy:
        model = strategy.mirror(net)

        def backward_only(batch):
            bx, by = batch
            mirrored.compute_average_loss(
                F.cross_entropy(model(bx), by, reduction="none")
            ).backward()

        for _ in range(2):
            batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
            strategy.run(backward_only, args=(batch,))
    for a, b in zip(expected.parameters(), net.parameters(), strict=True):
        assert_close_float64(b.grad, a.grad)


CLIPS = {
    "norm_imported_by_name": lambda params: clip_grad_norm_(params, 1e-3),
    "norm": lambda params: torch.nn.utils.clip_grad_norm_(params, 1e-3),
    "value": lambda params: torch.nn.utils.clip_grad_value_(params, 1e-3),
}


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_clipping_inside_a_pipeline_step_is_refused_before_any_change(clip):
    """A pipeline's gradients reach param.grad only at optimizer.step(): clipping before it
    would clip nothing."""
    net = make_mlp()
    before = copy.deepcopy(net.state_dict())
    with _pipeline(num_microbatches=2) as strategy:
        model, optimizer = strategy.mirror(net, torch.optim.SGD(net.parameters(), lr=0.1))

        def step(batch):
            x, y = batch
            mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
            CLIPS[clip](model.parameters())
            optimizer.step()
            optimizer.zero_grad()

        batch = next(iter(strategy.experimental_distribute_dataset(make_batches()[:1])))
        with pytest.raises(TypeError, match=r"only at optimizer\.step\(\).*clip_grad_norm_"):
            strategy.run(step, (batch,))
    for name, value in net.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_fit_evaluate_predict_unchanged():
    batches = make_batches()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    loss = mirrored.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = mirrored.Model(make_mlp())
    reference.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    with _pipeline(schedule="1f1b") as strategy, strategy.scope():
        model = mirrored.Model(make_mlp())
        model.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        evaluated = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
        predicted = model.predict(x, batch_size=32, verbose=0)
    for key in expected:
        assert_close_float64(history[key], expected[key])
    assert_same_parameters(reference.module, model.module)
    plain = reference.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    for key in plain:
        assert evaluated[key] == pytest.approx(plain[key], rel=1e-5)
    torch.testing.assert_close(predicted, reference.predict(x, batch_size=32, verbose=0))


def test_fit_refuses_loss_scaling():
    with _pipeline() as strategy, strategy.scope():
        model = mirrored.Model(make_mlp())
        with pytest.raises(ValueError, match=r"16-mixed.*PipelineStrategy"):
            model.compile(
                optimizer="sgd", loss="sparse_categorical_crossentropy", precision="16-mixed"
            )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_steps_that_are_not_forward_then_backward_do_not_hang(schedule):
    (x, y), *_ = make_batches(num_examples=16)
    net = make_mlp()
    with _pipeline(schedule=schedule, num_microbatches=4, timeout_seconds=20) as strategy:
        model, optimizer = strategy.mirror(net, OPTIMIZERS["sgd"](net))
        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

        def forward_only(b):
            return model(b[0]).sum()  # grad mode on, no backward: activations dropped at the end

        def all_reduce_before_backward(b):
            out = model(b[0])
            count = mirrored.get_replica_context().all_reduce("sum", torch.ones(()))
            loss = mirrored.compute_average_loss(F.cross_entropy(out, b[1], reduction="none"))
            loss.backward()
            optimizer.step()
            return count

        strategy.run(forward_only, args=(batch,))
        counts = strategy.run(all_reduce_before_backward, args=(batch,))
        assert strategy.experimental_local_results(counts)[0].item() == 4


def test_outside_run_the_model_runs_its_stages_in_turn():
    net = make_mlp()
    expected = copy.deepcopy(net)
    x = torch.randn(5, 12)
    with _pipeline() as strategy:
        model = strategy.mirror(net)
        torch.testing.assert_close(model(x), expected(x))
        model.eval()
        assert not net.training


def test_dropout_streams_are_reproducible():
    def train(seed):
        torch.manual_seed(1)
        net = nn.Sequential(nn.Linear(12, 32), nn.Dropout(0.5), nn.Linear(32, 16), nn.Linear(16, 5))
        with _pipeline(schedule="1f1b", recompute=True) as strategy:
            model, optimizer = strategy.mirror(net, OPTIMIZERS["sgd"](net))
            torch.manual_seed(seed)
            for batch in strategy.experimental_distribute_dataset(make_batches(num_examples=64)):
                strategy.run(_train_step(model, optimizer), args=(batch,))
        return [p.detach().clone() for p in net.parameters()]

    first, again, other = train(0), train(0), train(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


# -- bad input ---------------------------------------------------------------------------------


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="schedule='zigzag'"):
        _pipeline(schedule="zigzag")
    with pytest.raises(ValueError, match="num_microbatches=0"):
        _pipeline(num_microbatches=0)
    with pytest.raises(ValueError, match="3 devices cannot hold 2 pipelines"):
        _pipeline(num_pipelines=2)
    with pytest.raises(ValueError, match="split='even'"):
        _pipeline(split="even")


def test_fewer_layers_than_stages_is_refused():
    with _pipeline() as strategy:
        with pytest.raises(ValueError, match=r"2 layer.*fewer than the 3 stages"):
            strategy.mirror(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
        with pytest.raises(ValueError, match="got 2 stage module"):
            strategy.mirror([nn.Linear(4, 4), nn.Linear(4, 2)])
        with pytest.raises(TypeError, match=r"nn\.Sequential"):
            strategy.mirror(nn.Linear(4, 4))
    with _pipeline(split=[3, 2]) as strategy, pytest.raises(ValueError, match="split points"):
        strategy.mirror(make_mlp())


def test_a_batch_smaller_than_the_micro_batches_is_refused_before_compute():
    net = make_mlp()
    before = [p.detach().clone() for p in net.parameters()]
    with _pipeline(num_microbatches=4) as strategy:
        model, optimizer = strategy.mirror(net, OPTIMIZERS["sgd"](net))
        (x, y), *_ = make_batches(num_examples=3, batch_size=3)
        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        with pytest.raises(ValueError, match="3 examples is smaller than the 4 micro-batches"):
            strategy.run(_train_step(model, optimizer), args=(batch,))
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


def test_stages_that_do_not_chain_are_refused_before_compute():
    net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(16, 5))  # 32 -> 16: broken
    with _pipeline() as strategy:
        model, optimizer = strategy.mirror(net, OPTIMIZERS["sgd"](net))
        batch = next(iter(strategy.experimental_distribute_dataset(make_batches(num_examples=16))))
        with pytest.raises(StageShapeError, match=r"stage 2 \(layers 2..2\).*stage 1's output"):
            strategy.run(_train_step(model, optimizer), args=(batch,))
        assert all(not stage.ops for stage in strategy.stage_timelines()[0])


def test_inputs_requiring_grad_and_late_backward_are_refused():
    net = make_mlp()
    with _pipeline() as strategy:
        model, optimizer = strategy.mirror(net, OPTIMIZERS["sgd"](net))
        batch = next(iter(strategy.experimental_distribute_dataset(make_batches(num_examples=16))))

        def needs_input_grad(b):
            return model(b[0].clone().requires_grad_())

        def backward_after_step(b):
            loss = model(b[0]).sum()
            optimizer.step()
            loss.backward()

        with pytest.raises(ValueError, match="must not require grad"):
            strategy.run(needs_input_grad, args=(batch,))
        with pytest.raises(RuntimeError, match="after its step ended"):
            strategy.run(backward_after_step, args=(batch,))
        with pytest.raises(ValueError, match="sync_batch_norm"):
            strategy.mirror(make_mlp(), sync_batch_norm=True)


def test_a_failing_stage_is_named_and_the_strategy_recovers():
    class Fragile(nn.Module):
        fail = True

        def forward(self, x):
            if self.fail:
                raise ArithmeticError("boom")
            return x

    batches = make_batches(num_examples=32)
    expected = make_mlp()
    train_plain(expected, OPTIMIZERS["sgd"](expected), batches)
    net = make_mlp()
    fragile = Fragile()
    layers = [*net, fragile]
    with _pipeline(split=[2, 4]) as strategy:
        model, optimizer = strategy.mirror(nn.Sequential(*layers), OPTIMIZERS["sgd"](net))
        dataset = list(strategy.experimental_distribute_dataset(batches))
        with pytest.raises(ArithmeticError, match="boom") as raised:
            strategy.run(_train_step(model, optimizer), args=(dataset[0],))
        assert any("pipeline stage 2 on cpu:2" in note for note in raised.value.__notes__)
        fragile.fail = False
        for batch in dataset:
            strategy.run(_train_step(model, optimizer), args=(batch,))
    assert_same_parameters(expected, net)


def test_close_stops_every_thread():
    import threading

    strategy = _pipeline()
    strategy.mirror(make_mlp())
    strategy.close()
    names = [t.name for t in threading.enumerate()]
    assert not [n for n in names if n.startswith(("mirrored-stage-", "mirrored-replica-"))]


def test_a_stage_stuck_past_the_timeout_fails_the_run_in_time_and_is_named():
    import threading
    import time

    release = threading.Event()

    class Stuck(nn.Module):
        def forward(self, x):
            if x.device.type != "meta":  # the shape check runs the stages on meta tensors
                release.wait(30)
            return x

    net = nn.Sequential(nn.Linear(12, 8), nn.Linear(8, 8), Stuck())
    strategy = _pipeline(num_microbatches=2, timeout_seconds=2)
    try:
        model = strategy.mirror(net)
        batch = next(iter(strategy.experimental_distribute_dataset(make_batches(num_examples=8))))
        started = time.monotonic()
        with pytest.raises(mirrored.SyncTimeoutError, match="stage 2 on cpu:2: F of micro-batch 0"):
            strategy.run(lambda b: model(b[0]), args=(batch,))
        # Not waited for again (it took twice the timeout); generous for a loaded machine.
        assert time.monotonic() - started < 2 + 3
        # Still stuck: the next run's forward waits for it, within the timeout, naming it.
        with pytest.raises(mirrored.SyncTimeoutError, match="stage 2 on cpu:2: F of micro-batch 0"):
            strategy.run(lambda b: model(b[0]), args=(batch,))
        release.set()  # once the stage returns, the strategy runs again
        outputs = strategy.run(lambda b: model(b[0]), args=(batch,))
        shapes = [tuple(o.shape) for o in strategy.experimental_local_results(outputs)]
        assert shapes == [(4, 8)] * 2
    finally:
        release.set()
        strategy.close()
