"""The size limits issue 22 set on src/mirrored: modules of one job, functions that read in one go.

The import layers themselves are checked by ``lint-imports`` in the test command.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "mirrored"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(SOURCE.rglob("*.py"))


def test_the_source_tree_is_found():
    assert len(_modules()) > 100


def test_no_module_is_over_the_line_limit():
    too_long = {
        str(path.relative_to(SOURCE)): lines
        for path in _modules()
        if (lines := path.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert too_long == {}, f"split these modules by job (at most {MAX_MODULE_LINES} lines)"


def test_no_function_is_over_the_line_limit():
    too_long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    too_long[f"{path.relative_to(SOURCE)}:{node.name}"] = lines
    assert too_long == {}, f"split these functions (at most {MAX_FUNCTION_LINES} lines)"
