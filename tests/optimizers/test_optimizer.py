"""The optimizer specs: the torch optimizer each builds, its updates against torch's and against
Keras's published update rules (written out below, Keras not being installed), learning rates,
``get`` and every argument error.

Few tests with loops over tables, not one test per case: the conftest's hygiene check costs
~0.1 s per test.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from mirrored import optimizers
from mirrored.optimizers import SGD, Adam, AdamW, Optimizer, RMSprop, schedules
from mirrored.optimizers.decoupled import DECOUPLED_WEIGHT_DECAY, SGDW, RMSpropW

Tensor = torch.Tensor

START = torch.tensor([0.5, -1.5, 2.0, 0.0], dtype=torch.float64)
GRADS = [
    torch.tensor([0.1, -0.2, 0.3, 0.05], dtype=torch.float64),
    torch.tensor([-0.4, 0.1, 0.2, -0.3], dtype=torch.float64),
    torch.tensor([0.2, 0.3, -0.1, 0.1], dtype=torch.float64),
]


def _run(optimizer_for: Callable[[list[Tensor]], torch.optim.Optimizer], steps: int) -> Tensor:
    """START after ``steps`` updates with GRADS (fixed gradients) by a fresh optimizer."""
    param = START.clone().requires_grad_()
    optimizer = optimizer_for([param])
    for grad in GRADS[:steps]:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


# -- what build() makes --------------------------------------------------------------------------

# (spec, the exact torch class, the param-group values it must have)
BUILDS: list[tuple[Optimizer, type[torch.optim.Optimizer], dict[str, Any]]] = [
    (
        Adam(),
        torch.optim.Adam,
        {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-7, "weight_decay": 0, "amsgrad": False},
    ),
    (
        Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6, amsgrad=True, weight_decay=0.1),
        torch.optim.AdamW,
        {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True},
    ),
    (
        AdamW(),
        torch.optim.AdamW,
        {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-7, "weight_decay": 0.004},
    ),
    (
        SGD(),
        torch.optim.SGD,
        {"lr": 0.01, "momentum": 0.0, "dampening": 0, "nesterov": False, "weight_decay": 0},
    ),
    (
        SGD(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        SGDW,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0},
    ),
    (
        RMSprop(),
        torch.optim.RMSprop,
        {"lr": 0.001, "alpha": 0.9, "eps": 1e-7, "momentum": 0.0, "centered": False},
    ),
    (
        RMSprop(0.01, rho=0.8, momentum=0.5, epsilon=0.0, centered=True, weight_decay=0.02),
        RMSpropW,
        {"lr": 0.01, "alpha": 0.8, "eps": 0.0, "momentum": 0.5, "weight_decay": 0.0},
    ),
]


def test_build_makes_the_torch_optimizer_with_keras_hyperparameters() -> None:
    for spec, torch_class, expected in BUILDS:
        param = torch.zeros(3, requires_grad=True)
        built = spec.build([param])
        assert type(built) is torch_class, spec
        group = built.param_groups[0]
        assert group["params"] == [param]
        for key, value in expected.items():
            assert group[key] == value, (spec, key)
        assert group["foreach"] is None, "torch picks its fast path"
        rate = spec.weight_decay if torch_class in (SGDW, RMSpropW) else None
        assert group.get(DECOUPLED_WEIGHT_DECAY) == rate

    first, second = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    built = SGD(0.1, weight_decay=0.5).build([{"params": [first]}, {"params": [second], "lr": 1}])
    assert [g["lr"] for g in built.param_groups] == [0.1, 1]
    assert [g[DECOUPLED_WEIGHT_DECAY] for g in built.param_groups] == [0.5, 0.5]


# -- updates -------------------------------------------------------------------------------------

# (spec, the torch optimizer with the same settings)
SAME_AS_TORCH: list[tuple[Optimizer, Callable[[list[Tensor]], torch.optim.Optimizer]]] = [
    (Adam(), lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-7)),
    (
        Adam(0.01, beta_1=0.5, amsgrad=True, weight_decay=0.1),
        lambda p: torch.optim.AdamW(
            p, lr=0.01, betas=(0.5, 0.999), eps=1e-7, weight_decay=0.1, amsgrad=True
        ),
    ),
    (AdamW(0.01), lambda p: torch.optim.AdamW(p, lr=0.01, eps=1e-7, weight_decay=0.004)),
    (SGD(0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (
        SGD(0.1, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    ),
    (
        RMSprop(0.01, rho=0.8, momentum=0.5, centered=True),
        lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.8, eps=1e-7, momentum=0.5, centered=True),
    ),
]


def test_updates_equal_torch_with_the_same_settings() -> None:
    for spec, reference in SAME_AS_TORCH:
        for steps in (1, 2):
            assert torch.equal(_run(spec.build, steps), _run(reference, steps)), (spec, steps)

    # Keras's weight decay: torch's update after a decay of the weights.
    lr, rate = 0.1, 0.3
    for spec, reference in [
        (SGD(lr, momentum=0.9, weight_decay=rate), lambda p: torch.optim.SGD(p, lr, 0.9)),
        (
            RMSprop(lr, momentum=0.5, weight_decay=rate),
            lambda p: torch.optim.RMSprop(p, lr, alpha=0.9, eps=1e-7, momentum=0.5),
        ),
    ]:
        param = START.clone().requires_grad_()
        plain = START.clone().requires_grad_()
        built, torch_optimizer = spec.build([param]), reference([plain])
        for grad in GRADS:
            param.grad, plain.grad = grad.clone(), grad.clone()
            built.step()
            with torch.no_grad():
                plain.mul_(1 - lr * rate)
            torch_optimizer.step()
        torch.testing.assert_close(param, plain, rtol=1e-15, atol=1e-15)


def _keras_adam(lr: float, b1: float, b2: float, amsgrad: bool, wd: float | None) -> Tensor:
    """Keras 3's Adam (``keras/src/optimizers/adam.py``) with epsilon=0."""
    p, m, v, v_max = START.clone(), torch.zeros(4), torch.zeros(4), torch.zeros(4)
    for t, g in enumerate(GRADS, start=1):
        if wd is not None:
            p = p - p * wd * lr
        alpha = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        m = m + (g - m) * (1 - b1)
        v = v + (g * g - v) * (1 - b2)
        if amsgrad:
            v_max = torch.maximum(v_max, v)
        p = p - alpha * m / (v_max if amsgrad else v).sqrt()
    return p


def _keras_sgd(lr: float, momentum: float, nesterov: bool, wd: float | None) -> Tensor:
    """Keras 3's SGD (``keras/src/optimizers/sgd.py``)."""
    p, velocity = START.clone(), torch.zeros(4)
    for g in GRADS:
        if wd is not None:
            p = p - p * wd * lr
        if momentum == 0:
            p = p - lr * g
            continue
        velocity = momentum * velocity - lr * g
        p = p + (momentum * velocity - lr * g if nesterov else velocity)
    return p


def _keras_rmsprop(
    lr: float, rho: float, momentum: float, centered: bool, wd: float | None
) -> Tensor:
    """Keras 3's RMSprop (``keras/src/optimizers/rmsprop.py``) with epsilon=0."""
    p, velocity, average, moment = START.clone(), torch.zeros(4), torch.zeros(4), torch.zeros(4)
    for g in GRADS:
        if wd is not None:
            p = p - p * wd * lr
        velocity = rho * velocity + (1 - rho) * g * g
        denominator = velocity
        if centered:
            average = rho * average + (1 - rho) * g
            denominator = velocity - average * average
        increment = lr * g / denominator.sqrt()
        if momentum > 0:
            moment = momentum * moment + increment
            increment = moment
        p = p - increment
    return p


def test_updates_follow_keras_rules_where_the_docstrings_say_they_do() -> None:
    """With epsilon=0 (its placement is the documented difference) and a constant rate."""
    cases: list[tuple[Optimizer, Tensor]] = [
        (Adam(0.01, epsilon=0.0), _keras_adam(0.01, 0.9, 0.999, False, None)),
        (
            Adam(0.01, 0.8, 0.99, epsilon=0.0, amsgrad=True, weight_decay=0.2),
            _keras_adam(0.01, 0.8, 0.99, True, 0.2),
        ),
        (AdamW(0.01, epsilon=0.0), _keras_adam(0.01, 0.9, 0.999, False, 0.004)),
        (SGD(0.1), _keras_sgd(0.1, 0.0, False, None)),
        (SGD(0.1, weight_decay=0.3), _keras_sgd(0.1, 0.0, False, 0.3)),
        (SGD(0.1, momentum=0.9), _keras_sgd(0.1, 0.9, False, None)),
        (
            SGD(0.1, momentum=0.9, nesterov=True, weight_decay=0.3),
            _keras_sgd(0.1, 0.9, True, 0.3),
        ),
        (RMSprop(0.01, epsilon=0.0), _keras_rmsprop(0.01, 0.9, 0.0, False, None)),
        (
            RMSprop(0.01, rho=0.8, momentum=0.5, epsilon=0.0, centered=True, weight_decay=0.2),
            _keras_rmsprop(0.01, 0.8, 0.5, True, 0.2),
        ),
    ]
    for spec, keras_result in cases:
        torch.testing.assert_close(_run(spec.build, len(GRADS)), keras_result, msg=repr(spec))


# -- the decoupled weight decay hook -------------------------------------------------------------


def _decayed_once(optimizer: torch.optim.Optimizer, param: Tensor) -> None:
    """One step with a zero gradient moves ``param`` (ones) by the decay alone: 1 - 0.1 * 0.5."""
    param.grad = torch.zeros_like(param)
    optimizer.step()
    torch.testing.assert_close(param.detach(), torch.full_like(param, 0.95), rtol=0, atol=1e-7)


def test_the_decay_runs_once_per_step_after_deep_copy_and_state_dict_loading() -> None:
    for cls in (SGDW, RMSpropW):
        param = torch.ones(3, requires_grad=True)
        optimizer = cls([param], lr=0.1, weight_decay=0.5)
        _decayed_once(optimizer, param)

        # As mirrored replicates an optimizer: a deep copy onto a copy of the parameters.
        replica_param = torch.ones(3, requires_grad=True)
        replica = copy.deepcopy(optimizer, {id(param): replica_param})
        assert replica.param_groups[0]["params"] == [replica_param]
        _decayed_once(replica, replica_param)

        # load_state_dict calls __setstate__ again: still one decay per step.
        fresh_param = torch.ones(3, requires_grad=True)
        fresh = cls([fresh_param], lr=0.1, weight_decay=0.5)
        fresh.load_state_dict(optimizer.state_dict())
        _decayed_once(fresh, fresh_param)

        # A state dict without the rate (from torch's own class) keeps the configured one.
        plain_state = cls.__mro__[1]([torch.ones(3, requires_grad=True)], lr=0.1).state_dict()
        loaded_param = torch.ones(3, requires_grad=True)
        loaded = cls([loaded_param], lr=0.1, weight_decay=0.5)
        loaded.load_state_dict(plain_state)
        _decayed_once(loaded, loaded_param)

    # The decay reads the current rate and skips parameters without gradients.
    stepped, frozen, other = (torch.ones(2, requires_grad=True) for _ in range(3))
    optimizer = SGDW([stepped, frozen], lr=0.1, weight_decay=0.5)
    optimizer.param_groups[0]["lr"] = 0.2  # as the training loop sets a scheduled rate
    stepped.grad = torch.zeros(2)
    other.grad = torch.zeros(2)  # not in the optimizer: untouched
    optimizer.step()
    assert stepped.tolist() == pytest.approx([0.9, 0.9])
    assert frozen.tolist() == [1.0, 1.0]
    assert other.tolist() == [1.0, 1.0]


# -- learning rates ------------------------------------------------------------------------------


class _Returns(schedules.LearningRateSchedule):
    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self, step: int) -> Any:
        return self.value

    def get_config(self) -> dict[str, Any]:
        return {"value": self.value}


def test_learning_rate_at_constants_and_schedules() -> None:
    constant = SGD(0.05)
    assert not constant.is_scheduled
    assert [constant.learning_rate_at(s) for s in (0, 7)] == [0.05, 0.05]
    assert isinstance(Adam(1).learning_rate_at(0), float)

    schedule = schedules.PiecewiseConstantDecay([1], [0.5, 0.1])
    scheduled = Adam(schedule)
    assert scheduled.is_scheduled
    assert [scheduled.learning_rate_at(s) for s in (0, 1, 2, 10)] == [0.5, 0.5, 0.1, 0.1]
    assert scheduled.build([torch.zeros(1, requires_grad=True)]).param_groups[0]["lr"] == 0.5
    # A warmup from 0: torch accepts lr=0 for the first update.
    warmup = SGD(schedules.CosineDecay(0.0, 10, warmup_target=0.1, warmup_steps=5))
    assert warmup.build([torch.zeros(1, requires_grad=True)]).param_groups[0]["lr"] == 0.0
    assert warmup.learning_rate_at(5) == pytest.approx(0.1)
    assert Adam(_Returns(torch.tensor(0.25))).learning_rate_at(3) == 0.25

    for bad_step in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"step=.*expected the optimizer step as an int"):
            constant.learning_rate_at(bad_step)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"returned 'fast' at step 0; a schedule must return"):
        Adam(_Returns("fast")).learning_rate_at(0)
    for value in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"at step 2; a learning rate must be a finite"):
            Adam(_Returns(value)).learning_rate_at(2)


# -- get -----------------------------------------------------------------------------------------


def test_get_by_name_and_instance() -> None:
    for name, cls in [("adam", Adam), ("ADAM", Adam), ("AdamW", AdamW), ("sgd", SGD)]:
        spec = optimizers.get(name)
        assert type(spec) is cls
        assert spec.get_config() == cls().get_config()
    assert type(optimizers.get("RMSprop")) is RMSprop
    spec = SGD(0.3)
    assert optimizers.get(spec) is spec

    with pytest.raises(ValueError, match=r"'adamax' is not a known.*\['adam', 'adamw', 'rmsprop'"):
        optimizers.get("adamax")
    torch_optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for other in (torch_optimizer, torch.optim.SGD, 3, None):
        with pytest.raises(TypeError, match=r"expected a name \(adam, adamw, rmsprop, sgd\), a"):
            optimizers.get(other)  # type: ignore[arg-type]


# -- config --------------------------------------------------------------------------------------


def test_get_config_is_keras_named_json_and_round_trips() -> None:
    assert AdamW().get_config() == {
        "learning_rate": 0.001,
        "weight_decay": 0.004,
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-7,
        "amsgrad": False,
    }
    assert SGD().get_config() == {
        "learning_rate": 0.01,
        "weight_decay": None,
        "momentum": 0.0,
        "nesterov": False,
    }
    assert RMSprop().get_config() == {
        "learning_rate": 0.001,
        "weight_decay": None,
        "rho": 0.9,
        "momentum": 0.0,
        "epsilon": 1e-7,
        "centered": False,
    }
    schedule = schedules.ExponentialDecay(0.1, 100, 0.9, staircase=True)
    for spec in (Adam(schedule, weight_decay=0.01), SGD(schedule, 0.9, True), RMSprop(0.1)):
        config = json.loads(json.dumps(spec.get_config()))
        rebuilt = type(spec).from_config(config)
        assert rebuilt.get_config() == spec.get_config()
        assert rebuilt.learning_rate_at(250) == spec.learning_rate_at(250)
    assert Adam(schedule).get_config()["learning_rate"] == {
        "class_name": "ExponentialDecay",
        "config": schedule.get_config(),
    }
    assert repr(SGD(schedule, momentum=0.5)) == (
        f"SGD(learning_rate={schedule!r}, weight_decay=None, momentum=0.5, nesterov=False)"
    )


# -- argument errors -----------------------------------------------------------------------------

INVALID: Sequence[tuple[Callable[[], Any], type[Exception], str]] = [
    (lambda: Adam(0), ValueError, r"Adam: learning_rate=0; expected a number > 0"),
    (lambda: SGD(-0.1), ValueError, r"SGD: learning_rate=-0.1; expected a number > 0"),
    (lambda: RMSprop(math.nan), ValueError, r"learning_rate=nan; expected a finite number"),
    (lambda: Adam("0.1"), TypeError, r"learning_rate='0.1' is a str; expected a positive"),
    (lambda: Adam(True), TypeError, r"learning_rate=True is a bool"),
    (lambda: Adam(torch.tensor(0.1)), TypeError, r"is a Tensor.*compile\(lr_scheduler=...\)"),
    (lambda: Adam(lambda: 0.1), TypeError, r"is a function; expected a positive number or a"),
    (
        lambda: Adam(
            torch.optim.lr_scheduler.StepLR(
                torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), step_size=1
            )
        ),
        TypeError,
        r"learning_rate is a torch StepLR.*pass it as compile\(lr_scheduler=...\) with a torch",
    ),
    (lambda: Adam(beta_1=1.0), ValueError, r"Adam: beta_1=1.0; expected a number in \[0, 1\)"),
    (lambda: Adam(beta_1=-0.1), ValueError, r"beta_1=-0.1"),
    (lambda: AdamW(beta_2=1.5), ValueError, r"AdamW: beta_2=1.5; expected a number in \[0, 1\)"),
    (lambda: Adam(epsilon=-1e-7), ValueError, r"Adam: epsilon=-1e-07; expected a number >= 0"),
    (lambda: Adam(amsgrad=1), TypeError, r"Adam: amsgrad=1; expected True or False"),
    (lambda: Adam(weight_decay=-0.01), ValueError, r"Adam: weight_decay=-0.01; expected"),
    (lambda: Adam(weight_decay="0.1"), TypeError, r"weight_decay='0.1' is a str"),
    (lambda: AdamW(weight_decay=None), ValueError, r"AdamW: weight_decay=None; .*use Adam"),
    (lambda: AdamW(weight_decay=-1), ValueError, r"AdamW: weight_decay=-1"),
    (lambda: SGD(momentum=-0.5), ValueError, r"SGD: momentum=-0.5; expected a number in \[0, 1\]"),
    (lambda: SGD(momentum=1.5), ValueError, r"momentum=1.5"),
    (lambda: SGD(nesterov=True), ValueError, r"nesterov=True with momentum=0.0; Nesterov"),
    (lambda: SGD(momentum=0.9, nesterov="yes"), TypeError, r"nesterov='yes'"),
    (lambda: SGD(weight_decay=-1e-4), ValueError, r"SGD: weight_decay=-0.0001"),
    (lambda: RMSprop(rho=1.0), ValueError, r"RMSprop: rho=1.0; expected a number in \[0, 1\)"),
    (lambda: RMSprop(rho=-0.1), ValueError, r"rho=-0.1"),
    (lambda: RMSprop(momentum=-0.1), ValueError, r"RMSprop: momentum=-0.1"),
    (lambda: RMSprop(epsilon=-1.0), ValueError, r"RMSprop: epsilon=-1.0"),
    (lambda: RMSprop(centered=None), TypeError, r"centered=None; expected True or False"),
    (lambda: RMSprop(weight_decay=-2), ValueError, r"RMSprop: weight_decay=-2"),
    (lambda: Optimizer(0.1, None).build([]), NotImplementedError, r"must implement _build"),
    (
        lambda: SGDW([torch.zeros(1, requires_grad=True)], weight_decay=-1),
        ValueError,
        r"SGDW: weight_decay=-1; expected a number >= 0",
    ),
    (
        lambda: RMSpropW([torch.zeros(1, requires_grad=True)], weight_decay=-1),
        ValueError,
        r"RMSpropW: weight_decay=-1; expected a number >= 0",
    ),
]


def test_invalid_arguments_are_named() -> None:
    for build, error, match in INVALID:
        with pytest.raises(error, match=match):
            build()
