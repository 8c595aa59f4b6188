"""The strict documentation build (scripts/build_docs.sh, as scripts/test.sh runs it) can fail.

Each test builds a copy of what mkdocs.yml reads in a temporary folder, so the repository's
docs and site/ stay untouched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# mkdocs.yml; docs/ (with its hooks.py); src/ for mkdocstrings; ARCHITECTURE.md, included by
# docs/architecture.md; benchmarks/, whose RESULTS.md and charts the hooks add.
BUILD_INPUTS = [
    "mkdocs.yml",
    "docs",
    "src",
    "ARCHITECTURE.md",
    "benchmarks",
    "scripts/build_docs.sh",
]
MIRRORED_STRATEGY = "src/mirrored/strategies/mirrored.py"

pytestmark = pytest.mark.slow  # a build takes 3-5 s


def _copy_build_inputs(folder: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__")
    for name in BUILD_INPUTS:
        source, target = ROOT / name, folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=ignore)
        else:
            shutil.copy2(source, target)
    (folder / ".venv").symlink_to(ROOT / ".venv")


def _build(folder: Path) -> subprocess.CompletedProcess[str]:
    # Python may write bytecode here, as it does on a machine where nobody turned that off.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return subprocess.run(
        ["bash", str(folder / "scripts" / "build_docs.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_broken_docstring_fails_the_build_and_is_named(tmp_path: Path) -> None:
    _copy_build_inputs(tmp_path)
    source = tmp_path / MIRRORED_STRATEGY
    text = source.read_text()
    # A parameter documented under a name the signature lacks, as a typo or a rename leaves it.
    documented = "\n        local_sgd: `LocalSGD("
    assert documented in text, "MirroredStrategy's Args changed: update this test"
    source.write_text(text.replace(documented, "\n        locl_sgd: `LocalSGD("))

    build = _build(tmp_path)

    output = build.stdout + build.stderr
    assert build.returncode != 0, f"the build passed a parameter that does not exist:\n{output}"
    assert f"{MIRRORED_STRATEGY}:" in output and "'locl_sgd'" in output, output


def test_the_site_holds_no_bytecode(tmp_path: Path) -> None:
    """docs/hooks.py is compiled into docs/__pycache__/, which mkdocs would copy to the site."""
    _copy_build_inputs(tmp_path)

    build = _build(tmp_path)

    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "docs" / "__pycache__").is_dir(), "Python wrote no bytecode: check nothing"
    copied = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "site").rglob("__pycache__"))
    assert not copied, f"the site holds {copied}: add the folder to mkdocs.yml's exclude_docs"
