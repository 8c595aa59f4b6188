"""Keras-named optimizer specs that build torch optimizers.

``Model.compile(optimizer=Adam(learning_rate=schedule))`` reads as in Keras: the spec carries
Keras's argument names and defaults and builds the torch optimizer on the model's parameters once
the model knows them; the update rule is torch's. Where torch's rule differs from Keras's, the
class docstring says how; the mapping is one line per argument in ``_build``.

Differences common to all four: Keras's momentum buffers accumulate ``learning_rate * gradient``,
torch's accumulate the gradient and scale by the current rate, so the two agree for a constant
rate and differ slightly while a schedule changes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import ParamsT

from mirrored.optimizers import schedules
from mirrored.optimizers._checks import boolean, fraction, non_negative, real
from mirrored.optimizers.decoupled import SGDW, RMSpropW
from mirrored.optimizers.schedules import LearningRateSchedule

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "RMSprop", "get"]


def _learning_rate(owner: str, value: Any) -> float | LearningRateSchedule:
    if isinstance(value, LearningRateSchedule):
        return value
    if isinstance(
        value, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    ):
        raise TypeError(
            f"{owner}: learning_rate is a torch {type(value).__name__}, which is attached to a "
            "torch optimizer and stepped by the training loop; pass it as "
            "compile(lr_scheduler=...) with a torch optimizer built on model.parameters(), or "
            "give a mirrored.optimizers.schedules schedule here"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{owner}: learning_rate={value!r} is a {type(value).__name__}; expected a positive "
            "number or a mirrored.optimizers.schedules.LearningRateSchedule (torch LR "
            "schedulers go to compile(lr_scheduler=...))"
        )
    rate = real(owner, "learning_rate", value)
    if rate <= 0:
        raise ValueError(f"{owner}: learning_rate={value!r}; expected a number > 0")
    return rate


class Optimizer:
    """A Keras-named spec of a torch optimizer: ``build(params)`` makes the torch optimizer,
    ``learning_rate_at(step)`` is the rate of update ``step`` (0-based) that the training loop
    sets before each update when ``learning_rate`` is a schedule."""

    # get()'s name for the class (Keras's default ``name``).
    name: ClassVar[str] = ""

    def __init__(
        self, learning_rate: float | LearningRateSchedule, weight_decay: float | None
    ) -> None:
        owner = type(self).__name__
        self.learning_rate: float | LearningRateSchedule = _learning_rate(owner, learning_rate)
        self.weight_decay = (
            None if weight_decay is None else non_negative(owner, "weight_decay", weight_decay)
        )

    @property
    def is_scheduled(self) -> bool:
        """Whether the learning rate changes with the step (a schedule)."""
        return isinstance(self.learning_rate, LearningRateSchedule)

    def learning_rate_at(self, step: int) -> float:
        """The learning rate of update ``step`` (the first update is step 0)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: expected the optimizer step as an int >= 0")
        if not isinstance(self.learning_rate, LearningRateSchedule):
            return self.learning_rate
        value = self.learning_rate(step)
        try:
            rate = float(value)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{self.learning_rate!r} returned {value!r} at step {step}; a schedule must "
                "return a number"
            ) from error
        if not rate >= 0 or rate == float("inf"):
            raise ValueError(
                f"{self.learning_rate!r} returned {rate!r} at step {step}; a learning rate "
                "must be a finite number >= 0"
            )
        return rate

    def build(self, params: ParamsT) -> torch.optim.Optimizer:
        """The torch optimizer on ``params`` (tensors or param groups), at the rate of step 0."""
        return self._build(params, self.learning_rate_at(0))

    def _build(self, params: ParamsT, lr: float) -> torch.optim.Optimizer:
        raise NotImplementedError(f"{type(self).__name__} must implement _build(params, lr)")

    def _hyperparameters(self) -> dict[str, Any]:
        """The class's own constructor arguments, Keras's names, in Keras's config order."""
        return {}

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments, JSON-able; a schedule as {"class_name", "config"}."""
        learning_rate: Any = self.learning_rate
        if isinstance(learning_rate, LearningRateSchedule):
            learning_rate = schedules.serialize(learning_rate)
        return {
            "learning_rate": learning_rate,
            "weight_decay": self.weight_decay,
            **self._hyperparameters(),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Optimizer:
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = schedules.deserialize(config["learning_rate"])
        return cls(**config)

    def __repr__(self) -> str:
        config = {**self.get_config(), "learning_rate": self.learning_rate}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in config.items())})"


class Adam(Optimizer):
    """Adam (Kingma & Ba, arXiv:1412.6980): ``torch.optim.Adam``, or ``torch.optim.AdamW`` when
    ``weight_decay`` is given, since Keras's weight decay is decoupled (``w -= lr * wd * w``
    before the update), which is exactly AdamW's.

    Keras's ``epsilon`` is "epsilon hat": added to the square root of the *uncorrected* second
    moment, where torch's ``eps`` is added after bias correction. Passed as torch's ``eps``, it
    weighs ``1 / sqrt(1 - beta_2 ** t)`` times less than in Keras (about 32x at step 1, 1x late in
    training); with ``epsilon=0`` the two updates are identical.
    """

    name = "adam"

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        weight_decay: float | None = None,
    ) -> None:
        super().__init__(learning_rate, weight_decay)
        owner = type(self).__name__
        self.beta_1 = fraction(owner, "beta_1", beta_1)
        self.beta_2 = fraction(owner, "beta_2", beta_2)
        self.epsilon = non_negative(owner, "epsilon", epsilon)
        self.amsgrad = boolean(owner, "amsgrad", amsgrad)

    def _build(self, params: ParamsT, lr: float) -> torch.optim.Optimizer:
        arguments: dict[str, Any] = {
            "lr": lr,
            "betas": (self.beta_1, self.beta_2),  # beta_1, beta_2 -> betas
            "eps": self.epsilon,  # epsilon -> eps (see the class docstring)
            "amsgrad": self.amsgrad,  # amsgrad -> amsgrad (both take the max of v)
        }
        if self.weight_decay is None:
            return torch.optim.Adam(params, **arguments)
        # weight_decay (decoupled in Keras) -> AdamW's weight_decay (decoupled).
        return torch.optim.AdamW(params, weight_decay=self.weight_decay, **arguments)

    def _hyperparameters(self) -> dict[str, Any]:
        return {
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
            "amsgrad": self.amsgrad,
        }


class AdamW(Adam):
    """AdamW (Loshchilov & Hutter, arXiv:1711.05101): ``torch.optim.AdamW``, whose decoupled
    weight decay is Keras's. ``epsilon`` differs as in ``Adam``."""

    name = "adamw"

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.001,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
    ) -> None:
        if weight_decay is None:
            raise ValueError(
                "AdamW: weight_decay=None; expected a number >= 0 (use Adam for no weight decay)"
            )
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay)


class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum: ``torch.optim.SGD``, or
    ``mirrored.optimizers.decoupled.SGDW`` (torch's SGD plus a pre-step ``w -= lr * wd * w``)
    when ``weight_decay`` is given, since Keras's weight decay is decoupled and torch SGD's is L2
    on the gradient (the same only without momentum).

    Keras's ``velocity = momentum * velocity - lr * g`` is torch's buffer times ``-lr``: the
    updates agree exactly for a constant learning rate, Nesterov's included.
    """

    name = "sgd"

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float | None = None,
    ) -> None:
        super().__init__(learning_rate, weight_decay)
        owner = type(self).__name__
        self.momentum = fraction(owner, "momentum", momentum, include_one=True)
        self.nesterov = boolean(owner, "nesterov", nesterov)
        if self.nesterov and self.momentum == 0:
            raise ValueError(
                f"SGD: nesterov=True with momentum={momentum!r}; Nesterov momentum needs "
                "momentum > 0 (e.g. 0.9), or pass nesterov=False"
            )

    def _build(self, params: ParamsT, lr: float) -> torch.optim.Optimizer:
        arguments: dict[str, Any] = {
            "lr": lr,
            "momentum": self.momentum,  # momentum -> momentum (dampening 0)
            "nesterov": self.nesterov,  # nesterov -> nesterov
        }
        if self.weight_decay is None:
            return torch.optim.SGD(params, **arguments)
        # weight_decay (decoupled in Keras) -> SGDW's weight_decay (decoupled).
        return SGDW(params, weight_decay=self.weight_decay, **arguments)

    def _hyperparameters(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "nesterov": self.nesterov}


class RMSprop(Optimizer):
    """RMSprop (Hinton, 2012): ``torch.optim.RMSprop`` with ``alpha=rho``, or
    ``mirrored.optimizers.decoupled.RMSpropW`` when ``weight_decay`` is given (Keras's decay is
    decoupled, torch RMSprop's is L2 on the gradient).

    Keras adds ``epsilon`` inside the square root, ``g / sqrt(v + epsilon)``; torch outside,
    ``g / (sqrt(v) + eps)``. Passed as torch's ``eps``, it matters only where ``v`` is about
    ``epsilon`` or smaller; with ``epsilon=0`` the two updates are identical (momentum: as SGD's,
    exact for a constant learning rate).
    """

    name = "rmsprop"

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        weight_decay: float | None = None,
    ) -> None:
        super().__init__(learning_rate, weight_decay)
        owner = type(self).__name__
        self.rho = fraction(owner, "rho", rho)
        self.momentum = fraction(owner, "momentum", momentum, include_one=True)
        self.epsilon = non_negative(owner, "epsilon", epsilon)
        self.centered = boolean(owner, "centered", centered)

    def _build(self, params: ParamsT, lr: float) -> torch.optim.Optimizer:
        arguments: dict[str, Any] = {
            "lr": lr,
            "alpha": self.rho,  # rho -> alpha (the decay of the squared-gradient average)
            "eps": self.epsilon,  # epsilon -> eps (see the class docstring)
            "momentum": self.momentum,  # momentum -> momentum
            "centered": self.centered,  # centered -> centered
        }
        if self.weight_decay is None:
            return torch.optim.RMSprop(params, **arguments)
        # weight_decay (decoupled in Keras) -> RMSpropW's weight_decay (decoupled).
        return RMSpropW(params, weight_decay=self.weight_decay, **arguments)

    def _hyperparameters(self) -> dict[str, Any]:
        return {
            "rho": self.rho,
            "momentum": self.momentum,
            "epsilon": self.epsilon,
            "centered": self.centered,
        }


# Each class built with Keras's defaults.
_BY_NAME: dict[str, Callable[[], Optimizer]] = {
    cls.name: cls for cls in (Adam, AdamW, SGD, RMSprop)
}


def get(identifier: str | Optimizer) -> Optimizer:
    """The optimizer spec for ``identifier``: a name ("adam", "adamw", "sgd", "rmsprop", any
    case, with Keras's defaults) or a spec, returned as it is."""
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, str):
        cls = _BY_NAME.get(identifier.lower())
        if cls is None:
            raise ValueError(
                f"optimizer={identifier!r} is not a known optimizer; expected one of "
                f"{sorted(_BY_NAME)}"
            )
        return cls()
    raise TypeError(
        f"optimizer={identifier!r} is a {type(identifier).__name__}; expected a name "
        f"({', '.join(sorted(_BY_NAME))}), a mirrored.optimizers.Optimizer or a "
        "torch.optim.Optimizer built on model.parameters()"
    )
