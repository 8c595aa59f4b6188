"""Once every strategy, mirrored optimizer and replica stream is gone, torch is torch again: its
own functions are back where mirrored patched them, and a plain training loop run then equals the
same loop in an interpreter that never imported mirrored, bit for bit."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingWarmRestarts, LRScheduler, StepLR

import mirrored
from tests.torch_patches.plain_loop import train_plain

ROOT = Path(__file__).resolve().parents[2]
# torch's subclasses of LRScheduler that define a step of their own (StepLR inherits its).
_OWN_STEPS = (LRScheduler, CosineAnnealingWarmRestarts)


def _torch_s_objects() -> dict[str, object]:
    """What mirrored patches, as torch holds it now (a class's own attribute, None where it
    only inherits one)."""
    clip_grad, checkpoint = torch.nn.utils.clip_grad, torch.utils.checkpoint
    readers = ("clip_grad_norm_", "clip_grad_value_")
    helpers = ("_group_tensors_by_device_and_dtype", "_clip_grads_with_norm_")
    implementations = ("CheckpointFunction", "_checkpoint_without_reentrant_generator")
    return {
        **{f"torch.nn.utils.{name}": getattr(torch.nn.utils, name) for name in readers},
        **{f"clip_grad.{name}": getattr(clip_grad, name) for name in readers + helpers},
        **{f"{cls.__name__}.step": vars(cls)["step"] for cls in _OWN_STEPS},
        "LRScheduler.__init_subclass__": vars(LRScheduler).get("__init_subclass__"),
        "GradScaler.scale": vars(torch.amp.GradScaler)["scale"],
        **{name: getattr(checkpoint, name) for name in implementations},
        "torch.get_rng_state": torch.get_rng_state,
    }


def _patched(own: dict[str, object]) -> set[str]:
    return {name for name, found in _torch_s_objects().items() if found is not own[name]}


class _Checkpointed(nn.Module):
    """A model whose hidden layer, dropout included, is recomputed in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.25))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False))


def _late_step(self: LRScheduler) -> None:
    """The step of a scheduler class defined while the patches are installed."""
    LRScheduler.step(self)


def _train_mirrored(strategy: mirrored.MirroredStrategy, scheduler_class: type) -> list[object]:
    """Two steps inside ``strategy.run`` with activation checkpointing, both clipping functions
    and two LR schedulers stepped by every replica; the model, its optimizer and schedulers
    (patches are held while the optimizer lives)."""
    module = _Checkpointed()
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
    schedulers = [StepLR(optimizer, 1, gamma=0.5), scheduler_class(optimizer, 1, gamma=0.5)]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = F.cross_entropy(model(x), y, reduction="none")
        mirrored.compute_average_loss(per_example).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        for scheduler in schedulers:
            scheduler.step()

    batches = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(2)]
    for shards in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=shards)
    assert optimizer.param_groups[0]["lr"] == 0.1 * 0.5**2 * 0.5**2  # each once per update
    return [model, optimizer, *schedulers]


def test_torch_s_own_objects_are_back_once_the_last_strategy_is_gone():
    gc.collect()  # earlier tests' strategies
    own = _torch_s_objects()
    assert not any(getattr(o, "__module__", "").startswith("mirrored") for o in own.values())
    first = mirrored.MirroredStrategy(["cpu:0", "cpu:1"])
    second = mirrored.MirroredStrategy(["cpu:2", "cpu:3"])

    class Late(StepLR):  # defined while patched: routed through __init_subclass__
        step = _late_step

    trained = {id(s): _train_mirrored(s, Late) for s in (first, second)}
    patched = _patched(own) - {"torch.get_rng_state"}  # refused on an unknown torch only
    assert patched == set(own) - {"torch.get_rng_state"} and vars(Late)["step"] is not _late_step
    first.close()
    del trained[id(first)], first
    gc.collect()
    assert _patched(own) == patched  # the second strategy still holds every patch
    second.close()
    del trained, second
    gc.collect()
    assert _patched(own) == set()
    assert vars(Late)["step"] is _late_step


def test_a_plain_loop_after_strategies_equals_one_in_a_fresh_interpreter(tmp_path):
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        _train_mirrored(strategy, StepLR)
    del strategy
    gc.collect()
    here = train_plain()
    saved = tmp_path / "fresh.pt"
    subprocess.run(
        [sys.executable, "-m", "tests.torch_patches.plain_loop", str(saved)],
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    fresh = torch.load(saved, weights_only=True)
    assert sorted(here) == sorted(fresh)
    for name, tensor in fresh.items():
        assert torch.equal(here[name], tensor), name


def test_ours_under_a_later_patch_of_another_s_stays_and_calls_torch_s_own():
    gc.collect()  # earlier tests' mirrored optimizers
    own = vars(torch.amp.GradScaler)["scale"]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        module = nn.Linear(2, 1)
        held = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
        ours = vars(torch.amp.GradScaler)["scale"]
        assert ours is not own

        def theirs(self: torch.amp.GradScaler, outputs: torch.Tensor) -> torch.Tensor:
            return ours(self, outputs)

        torch.amp.GradScaler.scale = theirs  # type: ignore[method-assign]
        try:
            del held  # the last mirrored optimizer: the patch is removed
            gc.collect()
            assert vars(torch.amp.GradScaler)["scale"] is theirs
            scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
            scaled = strategy.run(lambda: scaler.scale(torch.ones(())))  # not refused
        finally:
            torch.amp.GradScaler.scale = own  # type: ignore[method-assign]
    assert [float(s) for s in strategy.experimental_local_results(scaled)] == [4.0, 4.0]


def test_closing_the_last_strategy_puts_torch_back_while_the_program_keeps_its_model():
    """A notebook keeps ``model`` and ``optimizer`` after its ``with strategy:`` block: the
    patches go at the close, not when those are collected."""
    gc.collect()  # earlier tests' strategies
    own = _torch_s_objects()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        kept = _train_mirrored(strategy, StepLR)
        assert _patched(own) - {"torch.get_rng_state"}
    assert _patched(own) == set()
    assert kept  # still referenced: nothing was collected
