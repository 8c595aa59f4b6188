"""A replayed step hands its gradients to the gradient reducer in one call, with no autograd
pass and no hook per parameter, and leaves what eager backward leaves; where only that pass
does what eager backward does, the replay runs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored.replication import gradient_reducer
from mirrored.tracing import capture
from tests.reference_loops import assert_close_float64
from tests.tracing.test_function import batches, make_model
from tests.tracing.traces import replays

pytestmark = pytest.mark.usefixtures("float64")

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@pytest.fixture
def hook_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times a gradient reducer's hook ran in a backward pass that accumulates into
    ``.grad`` (once per mirrored parameter in each; a trace's ``torch.autograd.grad`` does not
    count)."""
    calls = [0]
    accumulates = gradient_reducer._accumulates

    def counted(accumulator: Any) -> bool:
        accumulating = accumulates(accumulator)
        calls[0] += accumulating
        return accumulating

    monkeypatch.setattr(gradient_reducer, "_accumulates", counted)
    return calls


def through_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replays hand no gradients over: they run the autograd pass, as before the handover."""
    monkeypatch.setattr(capture, "hand_over", lambda leaves, grads: False)


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))


def zero_first(model: Any, optimizer: Any) -> Step:
    """zero_grad() before backward: after each run every replica's .grad is the global
    batch's gradient."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
        return loss

    return step


def never_zeroed(model: Any, optimizer: Any) -> Step:
    """No zero_grad(): each backward adds to the gradient the last one left."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
        return loss

    return step


def train(
    traced: bool,
    make_step: Callable[[Any, Any], Step],
    hook: bool = False,
    model: nn.Module | None = None,
    data: list[tuple[torch.Tensor, ...]] | None = None,
    prepare: Callable[[Any], object] | None = None,
    **strategy_options: Any,
) -> tuple[list[nn.Module], Any]:
    """Each replica's modules after a step on each of ``data`` (by default four batches) on 2
    replicas, and the step; ``prepare`` sees the mirrored model before the first."""
    model = model or make_model()
    if hook:
        model[0].weight.register_hook(lambda grad: grad * 2)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], **strategy_options) as strategy:
        mirrored_model, optimizer = strategy.mirror(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        )
        if prepare is not None:
            prepare(mirrored_model)
        step = make_step(mirrored_model, optimizer)
        step = mirrored.function(step) if traced else step
        for x, y in strategy.experimental_distribute_dataset(data or batches()):
            strategy.run(step, args=(x, y))
        assert not traced or replays(step)
    return list(mirrored_model.replicas), step


def assert_same_replicas(
    expected: list[nn.Module], actual: list[nn.Module], bitwise: bool = False
) -> None:
    """Every replica's parameters and ``.grad``: bit for bit, or to float64's reordering (a
    trace's backward runs autograd's decomposition of an eager kernel)."""
    for replica, (eager, traced) in enumerate(zip(expected, actual, strict=True)):
        for (name, a), b in zip(eager.named_parameters(), traced.parameters(), strict=True):
            pairs = [(a, b, name)]
            assert (a.grad is None) == (b.grad is None), f"replica {replica}: {name}.grad"
            if a.grad is not None and b.grad is not None:
                pairs.append((a.grad, b.grad, f"{name}.grad"))
            for x, y, what in pairs:
                if bitwise:
                    assert torch.equal(x, y), f"replica {replica}: {what}"
                else:
                    assert_close_float64(y, x, msg=f"replica {replica}: {what}")


def test_a_replay_sums_its_gradients_with_no_autograd_pass(
    hook_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    handed_over, _ = train(True, zero_first)
    assert hook_calls[0] == 0  # neither the trace nor the replays ran a pass
    assert all(p.grad is not None for replica in handed_over for p in replica.parameters())
    eager, _ = train(False, zero_first)
    assert hook_calls[0] > 0
    assert_same_replicas(eager, handed_over)
    through_autograd(monkeypatch)
    assert_same_replicas(train(True, zero_first)[0], handed_over, bitwise=True)


@pytest.mark.parametrize(
    ("make_step", "hook"),
    [(never_zeroed, False), (zero_first, True)],
    ids=["a gradient already there", "a hook of the program's"],
)
def test_a_replay_runs_the_autograd_pass_where_only_it_does_as_eager(
    hook_calls: list[int], make_step: Callable[[Any, Any], Step], hook: bool
) -> None:
    traced, _ = train(True, make_step, hook)
    assert hook_calls[0] > 0
    eager, _ = train(False, make_step, hook)
    assert_same_replicas(eager, traced)


def test_one_backward_into_two_optimizers_parameters_runs_the_autograd_pass(
    hook_calls: list[int],
) -> None:
    """A leaf of each of two reducers (two mirrored modules, each with its optimizer)."""

    def run(traced: bool) -> tuple[list[nn.Module], Any]:
        with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
            return run_on(strategy, traced)

    def run_on(strategy: mirrored.MirroredStrategy, traced: bool) -> tuple[list[nn.Module], Any]:
        torch.manual_seed(0)
        first, second = nn.Linear(6, 8), nn.Linear(8, 4)
        a, a_optimizer = strategy.mirror(first, torch.optim.SGD(first.parameters(), lr=0.1))
        b, b_optimizer = strategy.mirror(second, torch.optim.Adam(second.parameters(), lr=0.1))

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_of(lambda inputs: b(torch.relu(a(inputs))), x, y)
            loss.backward()
            a_optimizer.step()
            b_optimizer.step()
            a_optimizer.zero_grad()
            b_optimizer.zero_grad()
            return loss

        step = mirrored.function(step) if traced else step
        for x, y in strategy.experimental_distribute_dataset(batches()):
            strategy.run(step, args=(x, y))
        assert not traced or replays(step)
        return [*a.replicas, *b.replicas], step

    traced, _ = run(True)
    assert hook_calls[0] > 0
    eager, _ = run(False)
    assert_same_replicas(eager, traced)


@pytest.mark.parametrize(
    "options",
    [{"local_sgd": mirrored.LocalSGD(2)}, {"gradient_accumulation_steps": 2}],
    ids=["local SGD", "accumulation"],
)
def test_updates_whose_hooks_decide_what_is_sent_run_the_autograd_pass(
    hook_calls: list[int], options: dict[str, Any]
) -> None:
    """Local SGD's local updates and an accumulation window's micro-steps send nothing: each
    replica's .grad stays its own (checked after the last step, a micro-step of a window)."""
    data = batches(count=3)
    traced, _ = train(True, zero_first, data=data, **options)
    assert hook_calls[0] > 0
    assert_same_replicas(train(False, zero_first, data=data, **options)[0], traced)
    first, second = (replica[0].weight.grad for replica in traced)
    assert first is not None and second is not None and not torch.equal(first, second)


@pytest.mark.parametrize("graph_alive", [False, True], ids=["", "a graph alive"])
def test_a_hook_on_a_parameter_s_gradient_accumulator_runs_at_each_replay(
    graph_alive: bool,
) -> None:
    """A hook registered on the autograd node that accumulates a parameter's gradient (as
    FSDP and Megatron do) runs in every backward pass: the replay runs that pass. Also while
    a graph through the node is alive (a forward outside ``run``, kept), which hides the
    node's hooks from the garbage collector's view."""
    calls: list[int] = []
    kept: list[torch.Tensor] = []

    def forward_kept(model: Any) -> None:
        if graph_alive:
            kept.append(model(torch.randn(2, 6)).sum())

    def hooked_step(model: Any, optimizer: Any) -> Step:
        step = zero_first(model, optimizer)
        hooked: set[int] = set()

        def with_hook(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            weight = model[0].weight
            if id(weight) not in hooked:  # once per replica, while the step traces
                hooked.add(id(weight))
                accumulator = weight.view_as(weight).grad_fn.next_functions[0][0]
                accumulator.register_hook(lambda *_: calls.append(1))
            return step(x, y)

        return with_hook

    traced, _ = train(True, hooked_step, prepare=forward_kept)
    replayed = len(calls)
    calls.clear()
    eager, _ = train(False, hooked_step, prepare=forward_kept)
    assert replayed == len(calls) == 2 * 4
    assert_same_replicas(eager, traced)


def test_parameters_frozen_when_mirrored_and_trained_later_are_summed_as_eager(
    hook_calls: list[int],
) -> None:
    """Frozen when mirrored, the reducer does not watch it yet; thawed before the first run, its
    first gradient is reduced at the pass's end, which watches it from then on."""

    def frozen() -> nn.Module:
        model = make_model()
        model[0].weight.requires_grad_(False)
        return model

    def thaw(model: Any) -> None:
        model[0].weight.requires_grad_(True)

    traced, _ = train(True, zero_first, model=frozen(), prepare=thaw)
    assert hook_calls[0] > 0
    assert_same_replicas(train(False, zero_first, model=frozen(), prepare=thaw)[0], traced)


def test_backward_into_the_same_input_twice_accumulates_once(hook_calls: list[int]) -> None:
    def into_weight_twice(model: Any, optimizer: Any) -> Step:
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad()
            loss = loss_of(model, x, y)
            weight = model[0].weight
            loss.backward(inputs=[weight, weight, model[2].weight])
            optimizer.step()
            return loss

        return step

    # With a hook of the program's, so that the replay runs the autograd pass.
    traced, _ = train(True, into_weight_twice, hook=True)
    assert hook_calls[0] > 0
    assert_same_replicas(train(False, into_weight_twice, hook=True)[0], traced)
