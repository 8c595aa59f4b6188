"""The API reference (docs/api/) documents every public name of ``mirrored``."""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import mirrored

API_PAGES = Path(__file__).resolve().parents[2] / "docs" / "api"


def _documented() -> set[str]:
    return {
        match
        for page in API_PAGES.glob("*.md")
        for match in re.findall(r"^::: (\S+)$", page.read_text(), re.MULTILINE)
    }


def _documented_as(name: str) -> set[str]:
    """The identifiers under which a page may document ``mirrored.NAME``."""
    value = getattr(mirrored, name)
    if isinstance(value, types.ModuleType):
        return {value.__name__}
    return {f"mirrored.{name}", f"{value.__module__}.{value.__qualname__}"}


def test_every_public_name_has_a_reference_entry() -> None:
    documented = _documented()
    missing = [name for name in mirrored.__all__ if not _documented_as(name) & documented]
    assert not missing, f"add '::: mirrored.NAME' to a page of docs/api/ for {missing}"


def test_every_reference_entry_names_something_that_exists() -> None:
    """mkdocs build --strict checks this too; here it fails fast, with the name."""
    unknown = []
    for identifier in _documented():
        module_name, _, attribute = identifier.rpartition(".")
        try:
            module = importlib.import_module(identifier)
        except ImportError:
            module = importlib.import_module(module_name)
            if not hasattr(module, attribute):
                unknown.append(identifier)
    assert not unknown, unknown


def test_the_strategies_page_opens_with_what_users_create() -> None:
    """The contract (for whoever writes a strategy) comes after the strategies users create."""
    page = (API_PAGES / "strategies.md").read_text()
    names = [e.rsplit(".", 1)[1] for e in re.findall(r"^::: (\S+)$", page, re.MULTILINE)]
    assert names[0] == "MirroredStrategy", names
    assert names[-2:] == ["Strategy", "InProcessStrategy"], names
    created = ["MultiWorkerMirroredStrategy", "ParameterServerStrategy", "PipelineStrategy"]
    assert all(n in names[:-2] for n in created), names
    assert "[mirrored.Model]" in page.split("\n::: ", 1)[0], "link the Model before the entries"
