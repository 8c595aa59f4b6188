"""``mirrored.function``: traced steps give the eager steps' parameters, retrace on a new
signature, and run as written, with a warning naming why, whatever a trace cannot replay."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored.tracing.capture import capture
from tests.reference_loops import (
    assert_replicas_identical,
    assert_same_parameters,
    replica_step,
)
from tests.tracing.traces import replays

pytestmark = pytest.mark.usefixtures("float64")

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
Step = Callable[..., Any]


def make_model(dropout: float = 0.0, batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(3)
    layers: list[nn.Module] = [nn.Linear(6, 16), nn.ReLU()]
    if batch_norm:
        layers.append(nn.BatchNorm1d(16))
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(16, 4))
    return nn.Sequential(*layers)


def batches(
    count: int = 4, size: int = 8, last: int | None = None
) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(11)
    sizes = [size] * count if last is None else [size] * (count - 1) + [last]
    return [
        (torch.randn(n, 6, generator=generator), torch.randint(0, 4, (n,), generator=generator))
        for n in sizes
    ]


def standard_step(model: Any, optimizer: Any) -> Step:
    """tests.reference_loops' replica step, on this module's (x, y) arguments."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return replica_step((x, y), model, optimizer)

    return step


def train(
    num_replicas: int,
    traced: bool,
    make_step: Callable[[Any, Any], Step] = standard_step,
    model: nn.Module | None = None,
    data: list[tuple[torch.Tensor, ...]] | None = None,
    **strategy_options: Any,
) -> tuple[mirrored.MirroredModule, list[float], Step]:
    """The model after a custom loop over ``data``, each step's loss, and the step."""
    torch.manual_seed(5)
    strategy = mirrored.MirroredStrategy(DEVICES[:num_replicas], **strategy_options)
    model = model if model is not None else make_model()
    mirrored_model, optimizer = strategy.mirror(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    step = make_step(mirrored_model, optimizer)
    if traced:
        step = mirrored.function(step)
    losses = []
    for x, y in strategy.experimental_distribute_dataset(data if data is not None else batches()):
        result = strategy.run(step, args=(x, y))
        result = result[0] if isinstance(result, tuple) else result
        losses.append(strategy.reduce("sum", result, axis=None).item())
    return mirrored_model, losses, step


@pytest.mark.parametrize("num_replicas", [1, 2, 4])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_traced_steps_train_to_the_eager_steps_parameters(
    num_replicas: int, dropout: float
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        traced, traced_losses, step = train(num_replicas, True, model=make_model(dropout))
    eager, eager_losses, _ = train(num_replicas, False, model=make_model(dropout))
    assert replays(step)
    assert step.experimental_get_tracing_count() == num_replicas
    assert_same_parameters(eager, traced)
    torch.testing.assert_close(
        torch.tensor(traced_losses), torch.tensor(eager_losses), rtol=1e-12, atol=0
    )
    assert_replicas_identical(traced)


def test_replicas_dropout_is_reproducible_and_their_own() -> None:
    first, first_losses, _ = train(2, True, model=make_model(0.5))
    second, second_losses, _ = train(2, True, model=make_model(0.5))
    assert first_losses == second_losses
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    # Each replica draws its own mask: a step whose replicas return their dropped-out inputs.
    strategy = mirrored.MirroredStrategy(DEVICES[:2])
    layer = strategy.mirror(nn.Dropout(0.5))

    @mirrored.function
    def masks(x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    ones = torch.ones(2, 64)
    result = strategy.run(
        masks, args=(strategy.experimental_distribute_values_from_function(lambda _: ones[:1]),)
    )
    parts = strategy.experimental_local_results(result)
    assert not torch.equal(parts[0], parts[1])


def test_a_ragged_last_batch_traces_again_and_trains_as_eager() -> None:
    data = batches(count=3, size=8, last=6)
    traced, _, step = train(2, True, data=data)
    eager, _, _ = train(2, False, data=data)
    assert step.experimental_get_tracing_count() == 4  # two signatures on two replicas
    assert replays(step)
    assert_same_parameters(eager, traced)


def test_changing_shapes_warn_naming_the_argument() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:1])

    @mirrored.function
    def total(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x.sum() * scale

    with pytest.warns(
        RuntimeWarning, match=r"traced 6 times on one replica; argument \[0\] keeps changing"
    ):
        for n in range(1, 7):
            strategy.run(total, args=(torch.ones(n), 2.0))
    assert strategy.run(total, args=(torch.ones(3), 2.0)).item() == 6.0


def test_a_python_argument_is_part_of_the_signature() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:1])

    @mirrored.function
    def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale

    assert strategy.run(scaled, args=(torch.ones(2), 2.0)).tolist() == [2.0, 2.0]
    assert strategy.run(scaled, args=(torch.ones(2), 3.0)).tolist() == [3.0, 3.0]
    assert scaled.experimental_get_tracing_count() == 2


def test_a_changed_module_or_mode_traces_again() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:1])
    model = strategy.mirror(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)))

    @mirrored.function
    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    x = torch.ones(2, 3)
    strategy.run(forward, args=(x,))
    model.eval()
    assert torch.equal(strategy.run(forward, args=(x,)), model.module(x))  # no dropout now
    model.module[0] = nn.Linear(3, 3).eval()  # new parameters, read instead of the old ones
    assert torch.equal(strategy.run(forward, args=(x,)), model.module(x))
    assert forward.experimental_get_tracing_count() == 3


def test_edits_to_parameters_between_steps_are_read_at_replay() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:2])
    model = strategy.mirror(nn.Linear(3, 1, bias=False))

    @mirrored.function
    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    x = torch.ones(1, 3)
    strategy.run(forward, args=(x,))
    with torch.no_grad():
        model.weight.fill_(2.0)  # outside run: carried to every replica
    result = strategy.run(forward, args=(x,))
    assert [r.item() for r in strategy.experimental_local_results(result)] == [6.0, 6.0]


def clipped_step(model: Any, optimizer: Any) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
        return loss, norm

    return step


def test_clipping_in_a_traced_step_clips_the_global_gradient() -> None:
    traced, _, step = train(2, True, clipped_step)
    eager, _, _ = train(2, False, clipped_step)
    assert replays(step)
    assert_same_parameters(eager, traced)


@pytest.mark.parametrize(
    "options",
    [{"gradient_accumulation_steps": 2}, {"zero_stage": 1}, {"zero_stage": 2}],
    ids=["accumulation", "zero1", "zero2"],
)
def test_update_features_hold_when_traced(options: dict[str, Any]) -> None:
    traced, _, step = train(2, True, **options)
    eager, _, _ = train(2, False, **options)
    assert replays(step)
    assert_same_parameters(eager, traced)


def decay_by_hand_step(model: Any, optimizer: Any) -> Step:
    counter = torch.zeros((), dtype=torch.int64)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)  # reads and writes only tensors held outside the step
        counter.add_(1)
        return loss

    step.counter = counter  # type: ignore[attr-defined]
    return step


def test_in_place_edits_of_outside_tensors_happen_once_per_step() -> None:
    """A trace runs such an edit for real (no fake tensor in it): it is undone, so the replay
    is the only one."""
    traced, _, step = train(2, True, decay_by_hand_step)
    eager, _, eager_step = train(2, False, decay_by_hand_step)
    assert replays(step)
    assert_same_parameters(eager, traced)
    assert step.python_function.counter.item() == eager_step.counter.item() == 2 * 4


def noisy_gradients(num_replicas: int, traced: bool) -> nn.Module:
    """Two steps with a gradient-noise hook of the program's on a parameter: the hook draws
    from the replica's random stream, as in an eager backward pass."""
    model = make_model()
    model[0].weight.register_hook(lambda grad: grad + 0.01 * torch.randn_like(grad))
    trained, _, step = train(num_replicas, traced, model=model, data=batches(count=2))
    assert not traced or replays(step)
    return trained


def test_a_program_s_gradient_hook_draws_from_the_replica_s_stream_when_traced() -> None:
    assert_same_parameters(noisy_gradients(2, traced=False), noisy_gradients(2, traced=True))


def test_batch_norm_buffers_are_aggregated_as_eager() -> None:
    traced, _, step = train(2, True, model=make_model(batch_norm=True))
    eager, _, _ = train(2, False, model=make_model(batch_norm=True))
    assert replays(step)
    assert_same_parameters(eager, traced)  # running statistics included
    assert_replicas_identical(traced)


def item_step(model: Any, optimizer: Any) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        if loss.item() > 100:  # a branch on a value: the host must see it
            loss = loss * 0
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def torch_optimizer_step(model: Any, optimizer: Any) -> Step:
    torch_optimizers: dict[int, torch.optim.Optimizer] = {}

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        replica = mirrored.get_replica_context()
        assert replica is not None
        # Each replica's own torch optimizer, on its (summed) gradients.
        torch_optimizer = torch_optimizers.setdefault(
            replica.local_replica_id, torch.optim.SGD(model.parameters(), lr=0.1)
        )
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        torch_optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def torch_zero_grad_step(model: Any, optimizer: Any) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for p in model.parameters():
            p.grad = None
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        return loss

    return step


def hand_clipping_step(model: Any, optimizer: Any) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.grad.mul_(0.5)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def batch_size_all_reduce_step(model: Any, optimizer: Any) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = F.cross_entropy(model(x), y, reduction="none")
        size = mirrored.get_replica_context().all_reduce("sum", x.shape[0])
        loss = per_example.sum() / size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def second_derivative_step(model: Any, optimizer: Any) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward(create_graph=True)  # gradients that are functions of the parameters
        optimizer.zero_grad()
        return loss.detach()

    return step


@pytest.mark.parametrize(
    ("make_step", "reason", "num_replicas"),
    [
        (item_step, r"reads a tensor's value on the host .* \(.*test_function.py:\d+\)", 2),
        (torch_optimizer_step, "uses .grad outside a mirrored optimizer", 2),
        (torch_zero_grad_step, "sets .grad outside a mirrored optimizer", 2),
        (hand_clipping_step, "uses .grad outside a mirrored optimizer", 2),
        (batch_size_all_reduce_step, "all_reduce of Python numbers inside the step", 2),
        # Summing gradients that carry a graph is refused eagerly from two replicas on.
        (second_derivative_step, "create_graph=True", 1),
    ],
    ids=[
        "item",
        "torch-optimizer",
        "torch-zero-grad",
        "hand-clipping",
        "all-reduce",
        "create-graph",
    ],
)
def test_what_cannot_be_traced_runs_as_written_with_one_warning(
    make_step: Callable[[Any, Any], Step], reason: str, num_replicas: int
) -> None:
    with pytest.warns(RuntimeWarning, match=reason) as caught:
        traced, traced_losses, step = train(num_replicas, True, make_step)
    assert sum("runs as written" in str(w.message) for w in caught) == 1
    eager, eager_losses, _ = train(num_replicas, False, make_step)
    assert not replays(step)
    assert_same_parameters(eager, traced)
    assert traced_losses == eager_losses


def test_outside_a_replica_the_function_runs_as_written() -> None:
    calls = []

    @mirrored.function
    def count(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x + 1

    assert count(torch.zeros(1)).item() == 1.0
    assert count(torch.zeros(1)).item() == 1.0
    assert len(calls) == 2
    assert count.experimental_get_tracing_count() == 0


def test_a_trace_changes_no_state_before_it_replays() -> None:
    """Tracing runs the step on fake tensors: nothing real moves until the replay."""
    strategy = mirrored.MirroredStrategy(DEVICES[:1])
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    mirrored_model, optimizer = strategy.mirror(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]

    def step() -> torch.Tensor:
        loss = F.cross_entropy(mirrored_model(x), y, reduction="sum")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    captured = strategy.run(lambda: capture(step, (), {}, [model]))
    assert len(captured.host_calls) == 3  # backward's gradients, step(), zero_grad()
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert b.grad is None


def test_a_step_may_return_none_and_python_values() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:2])
    model = strategy.mirror(nn.Linear(3, 1))

    @mirrored.function
    def nothing(x: torch.Tensor) -> None:
        model(x).sum()

    @mirrored.function
    def mixed(x: torch.Tensor) -> dict[str, Any]:
        return {"out": model(x), "label": "ok", "none": None}

    x = torch.ones(1, 3)
    for _ in range(2):  # the trace's call, then a replay
        assert strategy.run(nothing, args=(x,)) is None
        result = strategy.run(mixed, args=(x,))
        assert result["label"] == "ok" and result["none"] is None
    assert replays(nothing) and replays(mixed)


def test_a_pipeline_s_step_runs_as_written() -> None:
    """A pipeline's stages are not replicas of one module: nothing there to trace."""
    from tests.reference_loops import make_batches, make_mlp

    net = make_mlp()
    with mirrored.PipelineStrategy(devices=DEVICES[:2], num_microbatches=2) as strategy:
        model, optimizer = strategy.mirror(net, torch.optim.SGD(net.parameters(), lr=0.1))

        @mirrored.function
        def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(model(x), y, reduction="sum")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        for batch in strategy.experimental_distribute_dataset(make_batches(num_examples=16)):
            strategy.run(step, args=(batch,))
    assert step.experimental_get_tracing_count() == 0


def test_a_traced_function_pickles_as_its_function() -> None:
    copy = pickle.loads(pickle.dumps(mirrored.function(torch.neg)))
    assert copy.python_function is torch.neg
    assert copy.experimental_get_tracing_count() == 0
    assert copy(torch.ones(1)).item() == -1.0


def test_not_a_function_is_refused() -> None:
    with pytest.raises(TypeError, match="expects a function"):
        mirrored.function(3)  # type: ignore[call-overload]


def test_sync_batch_norm_s_meetings_run_as_written_without_a_hang() -> None:
    def trained(traced: bool) -> nn.Module:
        torch.manual_seed(5)
        strategy = mirrored.MirroredStrategy(DEVICES[:2])
        model = make_model(batch_norm=True)
        mirrored_model, optimizer = strategy.mirror(
            model, torch.optim.SGD(model.parameters(), lr=0.1), sync_batch_norm=True
        )
        step = standard_step(mirrored_model, optimizer)
        step = mirrored.function(step) if traced else step
        for x, y in strategy.experimental_distribute_dataset(batches(count=2)):
            strategy.run(step, args=(x, y))
        return model

    with pytest.warns(RuntimeWarning, match="a meeting of the replicas inside the step"):
        traced = trained(True)
    assert_same_parameters(trained(False), traced)


def test_the_value_of_a_tensor_held_outside_is_not_frozen() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:1])
    scale = torch.tensor(2.0)

    @mirrored.function
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * scale.item()

    with pytest.warns(RuntimeWarning, match="reads the value of a tensor held outside it"):
        assert strategy.run(scaled, args=(torch.ones(1),)).item() == 2.0
    scale.fill_(5.0)
    assert strategy.run(scaled, args=(torch.ones(1),)).item() == 5.0


class _Batch:
    """A container torch's pytrees do not open (as Transformers' BatchEncoding)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


def test_an_argument_that_is_no_value_runs_as_written() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:1])

    @mirrored.function
    def total(batch: _Batch) -> torch.Tensor:
        return batch.x.sum()

    with pytest.warns(RuntimeWarning, match=r"argument \[0\] is neither a tensor nor a value"):
        assert strategy.run(total, args=(_Batch(torch.ones(2)),)).item() == 2.0
    assert strategy.run(total, args=(_Batch(torch.ones(3)),)).item() == 3.0
    assert total.experimental_get_tracing_count() == 0


def test_autocast_is_part_of_the_signature() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:1])
    layer = strategy.mirror(nn.Linear(4, 4).float())

    @mirrored.function
    def forward(x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    x = torch.ones(2, 4, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert strategy.run(forward, args=(x,)).dtype == torch.bfloat16
    assert strategy.run(forward, args=(x,)).dtype == torch.float32
    assert forward.experimental_get_tracing_count() == 2


def test_backward_into_a_tensor_outside_the_mirrored_modules_runs_as_written() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:1])
    weight = torch.ones(3, requires_grad=True)
    weight.register_hook(lambda grad: grad * 2)

    @mirrored.function
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = (weight * x).sum()
        loss.backward()
        return loss

    with pytest.warns(RuntimeWarning, match="no parameter of a mirrored module"):
        strategy.run(step, args=(torch.ones(3),))
    assert weight.grad is not None and weight.grad.tolist() == [2.0, 2.0, 2.0]  # hooked once


class _Cached(nn.Module):
    """A module that builds a tensor on its first call and keeps it (a rotary or mask cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.arange(3.0)
        return self.linear(x) + self.cache


def test_a_tensor_a_step_stores_on_a_module_is_refused_and_left_real() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:1])
    model = strategy.mirror(_Cached())

    @mirrored.function
    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    x = torch.ones(1, 3)
    with pytest.warns(RuntimeWarning, match="stores a tensor it computes on a module"):
        result = strategy.run(forward, args=(x,))
    assert torch.equal(result, model.module(x))
    assert type(model.module.cache) is torch.Tensor  # real, not the trace's fake


def test_a_module_the_strategy_does_not_mirror_is_in_the_signature() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES[:1])
    model = strategy.mirror(nn.Linear(64, 64))
    teacher_dropout = nn.Dropout(0.5)  # not mirrored: a loss's or a teacher's module

    @mirrored.function
    def forward(x: torch.Tensor) -> torch.Tensor:
        return teacher_dropout(model(x))

    x = torch.ones(1, 64)
    strategy.run(forward, args=(x,))
    teacher_dropout.eval()
    assert torch.equal(strategy.run(forward, args=(x,)), model.module(x))  # no dropout now
    assert forward.experimental_get_tracing_count() == 2


def test_closing_a_strategy_drops_the_traces_made_on_it() -> None:
    traced, _, step = train(2, True, data=batches(count=1))
    strategy = traced._strategy
    assert step._replicas[strategy]  # the two replicas' traces
    strategy.close()
    assert not step._replicas.get(strategy)
