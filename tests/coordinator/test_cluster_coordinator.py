"""ClusterCoordinator's dependencies on its strategy, read from the source (no processes: the
coordinator at work is tested in tests/multiprocess/test_parameter_server.py)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

COORDINATOR_MODULES = [
    "mirrored.coordinator.cluster_coordinator",
    "mirrored.coordinator.per_worker_datasets",
    "mirrored.coordinator.ps_state",
]


def _tree(module: str) -> ast.Module:
    path = importlib.import_module(module).__file__
    assert path is not None
    return ast.parse(Path(path).read_text())


def _is_strategy(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "strategy") or (
        isinstance(node, ast.Attribute) and node.attr == "strategy"
    )


@pytest.mark.parametrize("module", COORDINATOR_MODULES)
def test_the_coordinator_uses_only_the_strategys_public_members(module):
    private = [
        f"line {node.lineno}: strategy.{node.attr}"
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.Attribute)
        and _is_strategy(node.value)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]
    assert private == []


def test_the_strategy_does_not_import_its_coordinator():
    imported = {  # every name an import binds, type-only imports included
        f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(_tree("mirrored.strategies.parameter_server"))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not [name for name in imported if "cluster_coordinator" in name]
