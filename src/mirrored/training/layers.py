"""``Model.get_layer`` and ``Model.summary``: Keras's view of a model's layers, on every replica.

Keras users freeze a layer with ``model.get_layer("encoder").trainable = False``. Here a layer is a
submodule of the model's module, named as ``named_modules`` names it; the handle finds it in
every replica each time it is used, so one taken before ``compile`` (which mirrors the module)
still reaches the replicas made after.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

__all__ = ["Layer", "find_layer", "layer_table"]


class _Replicated(Protocol):
    def _replica_modules(self) -> list[nn.Module]: ...


class Layer:
    """One layer of a ``mirrored.Model`` on every replica. ``trainable = False`` freezes its
    parameters (``requires_grad``) on all of them, so that they get no gradient and no update;
    other attributes, and calls, are those of replica 0's layer. Unlike Keras, a frozen
    BatchNorm still updates its running statistics in training mode."""

    def __init__(self, model: _Replicated, name: str) -> None:
        self.name = name
        self._model = model

    def _copies(self) -> list[nn.Module]:
        return [replica.get_submodule(self.name) for replica in self._model._replica_modules()]

    @property
    def module(self) -> nn.Module:
        """Replica 0's layer (the module the user built)."""
        return self._copies()[0]

    @property
    def trainable(self) -> bool:
        """False when a parameter of the layer is frozen (a layer without parameters is always
        trainable: it has nothing to freeze)."""
        return all(p.requires_grad for p in self.module.parameters())

    @trainable.setter
    def trainable(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"trainable={value!r}: expected True or False")
        for layer in self._copies():
            layer.requires_grad_(value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("name", "_model"):
            raise AttributeError(name)  # copy/pickle probes, or a half-built object
        return getattr(self.module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Layer(name={self.name!r}, module={type(self.module).__name__})"


def find_layer(model: _Replicated, module: nn.Module, name: str | None, index: int | None) -> Layer:
    """Keras's ``get_layer(name, index)`` on ``module``: exactly one of them; ``name`` among the
    dotted names of ``named_modules``, ``index`` among the top-level children."""
    children = [child_name for child_name, _ in module.named_children()]
    if (name is None) == (index is None):
        raise ValueError(
            f"get_layer(name={name!r}, index={index!r}): give a layer's name or its index, "
            f"not {'both' if name is not None else 'neither'}; the top-level layers are "
            f"{children}"
        )
    if index is not None:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"get_layer(index={index!r}): expected an int")
        if not -len(children) <= index < len(children):
            raise ValueError(
                f"get_layer(index={index}): the model has {len(children)} top-level layers "
                f"({children})"
            )
        return Layer(model, children[index])
    assert name is not None  # exactly one of name and index was given
    names = {n for n, _ in module.named_modules(remove_duplicate=False) if n}
    if name not in names:
        raise ValueError(
            f"get_layer(name={name!r}): no such layer; the top-level layers are {children} "
            "(a nested one is named with dots, as named_modules() names it, e.g. "
            "'encoder.layer.0')"
        )
    return Layer(model, name)


def layer_table(module: nn.Module, where: Any) -> str:
    """``Model.summary``'s table: ``module``'s top-level layers and their parameter counts, and
    the totals, headed by the module's class and ``where`` it runs (its strategy)."""
    rows = [("Layer (type)", "Param #")]
    for name, child in module.named_children():
        count = sum(p.numel() for p in child.parameters())
        rows.append((f"{name} ({type(child).__name__})", f"{count:,}"))
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    width = max(len(r[0]) for r in rows) + 4
    rule = "=" * (width + 14)
    lines = [f'Model: "{type(module).__name__}" on {where}', rule]
    lines += [f"{left:<{width}}{right:>14}" for left, right in rows[:1]]
    lines += [rule]
    lines += [f"{left:<{width}}{right:>14}" for left, right in rows[1:]]
    lines += [
        rule,
        f"Total params: {total:,} ({size / 2**20:.2f} MiB)",
        f"Trainable params: {trainable:,}",
        f"Non-trainable params: {total - trainable:,}",
    ]
    return "\n".join(lines)
