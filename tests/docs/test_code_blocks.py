"""Every code block of README.md and docs/ runs, or is checked, so that no snippet can rot.

How each block is tested is written above it in the page (``tests/docs/code_blocks.py``). Python
programs run in one process per page (``run_programs.py``); shell blocks marked ``run`` run with
bash in a folder holding the page's ``file`` blocks, with this environment's ``bin`` first on
PATH; the two sides of a ``same-output`` diff must print the same numbers.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest

from tests.docs.code_blocks import (
    CODE_LANGUAGES,
    KINDS,
    OTHER_LANGUAGES,
    ROOT,
    Block,
    Directive,
    Program,
    _directives_above,
    all_blocks,
    blocks,
    diff_sides,
    documentation_pages,
    python_programs,
)

BLOCKS = all_blocks()
PROGRAMS = [p for page in documentation_pages() for p in python_programs(blocks(page))]
SHELL_RUNS = [b for b in BLOCKS if b.language in ("bash", "console") and b.directive("run")]
NOT_RUN = [b for b in BLOCKS if b.directive("not-run")]
SAME_OUTPUT = [b for b in BLOCKS if b.directive("same-output")]
COVERED = [b for b in BLOCKS if b.directive("covered-by")]


def _ids(items: list[Block] | list[Program]) -> list[str]:
    return [item.name for item in items]


@cache
def _page_results(page: Path) -> dict[str, dict]:
    """Run every python program of one page (and the same-output diffs) in one process."""
    programs = [p for p in PROGRAMS if p.page == page]
    payload = [
        {"pieces": p.pieces, "logical_cpus": p.logical_cpus, "name": p.name} for p in programs
    ]
    for block in (b for b in SAME_OUTPUT if b.path == page):
        old, new = diff_sides(block.code)
        payload.append(
            {
                "pieces": [[block.name, block.line, old]],
                "logical_cpus": None,
                "name": f"{block.name} (old)",
            }
        )
        payload.append(
            {
                "pieces": [[block.name, block.line, new]],
                "logical_cpus": 2,
                "name": f"{block.name} (new)",
            }
        )
    if not payload:
        return {}
    folder = ROOT / ".pytest_cache" / "docs"
    folder.mkdir(parents=True, exist_ok=True)
    stem = str(page.relative_to(ROOT)).replace("/", "_")
    programs_file, results_file = folder / f"{stem}.programs.json", folder / f"{stem}.results.json"
    programs_file.write_text(json.dumps(payload))
    subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("run_programs.py")),
            str(programs_file),
            str(results_file),
        ],
        cwd=ROOT,
        check=True,
        timeout=600,
    )
    results = json.loads(results_file.read_text())
    return {entry["name"]: result for entry, result in zip(payload, results, strict=True)}


def test_every_code_block_says_how_it_is_tested() -> None:
    problems = []
    for block in BLOCKS:
        kinds = [d.kind for d in block.directives]
        if block.language not in CODE_LANGUAGES | OTHER_LANGUAGES:
            problems.append(f"{block.name}: fence language {block.language!r}")
        problems += [f"{block.name}: unknown test kind {k!r}" for k in kinds if k not in KINDS]
        if block.language in ("bash", "console") and not {"run", "not-run", "covered-by"} & set(
            kinds
        ):
            problems.append(f"{block.name}: a shell block needs run, not-run or covered-by")
        if block.language == "diff" and not {"same-output", "covered-by"} & set(kinds):
            problems.append(f"{block.name}: a diff block needs same-output or covered-by")
        not_run = block.directive("not-run")
        if not_run is not None and not not_run.argument:
            problems.append(f"{block.name}: not-run without a reason")
        if block.directive("tensorflow"):
            problems += _tensorflow_problems(block, kinds)
    assert not problems, "\n".join(problems)


def _tensorflow_problems(block: Block, kinds: list[str]) -> list[str]:
    """A ``tensorflow`` block is shown, never run: it must be Python that parses, and it cannot
    also be part of one of our programs."""
    if block.language != "python":
        return [f"{block.name}: a tensorflow block must be a python fence"]
    if kinds != ["tensorflow"]:
        return [f"{block.name}: a tensorflow block takes no other test kind, got {kinds}"]
    try:
        ast.parse(block.code)
    except SyntaxError as error:
        return [f"{block.name}: the TensorFlow code does not parse: {error}"]
    return []


def test_a_prelude_inside_a_content_tab_runs_dedented() -> None:
    lines = [
        '=== "mirrored"',
        "",
        "    <!-- test: prelude",
        "    if True:",
        "        x = 1",
        "    -->",
        "",
        "    ```python",
    ]
    [prelude] = _directives_above(lines, len(lines) - 1)
    assert prelude.body.strip("\n") == "if True:\n    x = 1"


def test_a_tensorflow_block_is_shown_and_never_run() -> None:
    page = ROOT / "docs" / "page.md"  # python_programs reads no file
    tensorflow = Block(page, 2, "python", "import tensorflow as tf\n", [Directive("tensorflow")])
    ours = Block(page, 6, "python", "x = 1\n")
    continued = Block(page, 10, "python", "print(x)\n", [Directive("continue")])
    [program] = python_programs([tensorflow, ours, continued])
    assert program.blocks == [ours, continued]
    assert _tensorflow_problems(tensorflow, ["tensorflow"]) == []
    broken = Block(page, 2, "python", "tf.function(\n", tensorflow.directives)
    assert "does not parse" in _tensorflow_problems(broken, ["tensorflow"])[0]


@pytest.mark.parametrize("program", PROGRAMS, ids=_ids(PROGRAMS))
def test_python_block_runs(program: Program) -> None:
    result = _page_results(program.page)[program.name]
    assert result["error"] is None, f"{program.name} failed:\n{result['error']}\n{result['output']}"


_NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?|-?\d+")


def _numbers(text: str) -> list[float]:
    return [float(n) for n in _NUMBER.findall(text)]


@pytest.mark.parametrize("block", SAME_OUTPUT, ids=_ids(SAME_OUTPUT))
def test_both_sides_of_a_diff_print_the_same_numbers(block: Block) -> None:
    """The program before the change on one device, after it on two logical devices."""
    results = _page_results(block.path)
    old, new = results[f"{block.name} (old)"], results[f"{block.name} (new)"]
    assert old["error"] is None, old["error"]
    assert new["error"] is None, new["error"]
    assert _NUMBER.sub("#", old["output"]) == _NUMBER.sub("#", new["output"])
    old_numbers, new_numbers = _numbers(old["output"]), _numbers(new["output"])
    assert old_numbers, "the program prints no numbers to compare"
    assert all(
        math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
        for a, b in zip(old_numbers, new_numbers, strict=True)
    ), (old["output"], new["output"])


def _page_files(block: Block, folder: Path) -> None:
    for other in blocks(block.path):
        written = other.directive("file")
        if written is not None and other.line < block.line:
            (folder / written.argument).write_text(other.code)


@pytest.mark.parametrize("block", SHELL_RUNS, ids=_ids(SHELL_RUNS))
def test_shell_block_runs(block: Block, tmp_path: Path) -> None:
    """``run multiprocess`` blocks start worker processes (mirrored launch, TF_CONFIG)."""
    _page_files(block, tmp_path)
    environ = dict(os.environ)
    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ['PATH']}"
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{block.name}:\n{result.stdout}\n{result.stderr}"


@cache
def _extras() -> set[str]:
    return set(metadata.metadata("mirrored").get_all("Provides-Extra") or [])


def _commands(shell: str) -> list[list[str]]:
    """The block's commands as words, comments and environment assignments left out."""
    commands, pending = [], ""
    for line in shell.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quotation that goes on over the next line
            continue
        pending = ""
        while words and re.fullmatch(r"[A-Za-z_]+=.*", words[0]):
            words = words[1:]
        if words:
            commands.append(words)
    return commands


def _script_sources(program: str, module: bool) -> list[Path]:
    """A repository script or example module, and the device flags every example takes."""
    if module:
        if not program.startswith("mirrored.examples."):
            return []
        program = f"examples/{program.removeprefix('mirrored.examples.')}.py"
    if not program.startswith(("benchmarks/", "examples/")):
        return []
    return [ROOT / program, ROOT / "examples" / "devices.py"]


def _flag_problems(words: list[str], sources: list[Path]) -> list[str]:
    text = "".join(path.read_text() for path in sources if path.exists())
    flags = [w.split("=")[0] for w in words if w.startswith("--")]
    return [f"no flag {flag} in {sources[0].name}" for flag in flags if f'"{flag}"' not in text]


def _launch_problems(words: list[str]) -> list[str]:
    """``mirrored launch`` flags, parsed by the launcher's own parser, then the script's."""
    import argparse

    from mirrored.launch import launcher as launch

    parser = argparse.ArgumentParser(prog="mirrored launch", exit_on_error=False)
    launch.add_arguments(parser)
    try:
        args = parser.parse_args(words)
    except argparse.ArgumentError as error:
        return [f"mirrored launch: {error}"]
    sources = _script_sources(args.script, args.module)
    return _flag_problems(args.script_args, sources) if sources else []


def _problems(block: Block) -> list[str]:
    from mirrored import cli

    problems = []
    for words in _commands(block.code):
        for word in words:
            for extras in re.findall(r"(?:mirrored|^\.)\[([\w,-]+)\]", word):
                problems += [f"no extra {e!r}" for e in extras.split(",") if e not in _extras()]
            path = re.match(r"(benchmarks|examples|scripts|docs|tests)/\S+\.\w+$", word)
            if path and not (ROOT / word).exists():
                problems.append(f"no file {word}")
        if words[:2] == ["mirrored", "launch"]:
            problems += _launch_problems(words[2:])
        elif words[:2] == ["mirrored", "train"]:
            if words[2] not in cli.EXAMPLES:
                problems.append(f"no example {words[2]!r}")
            problems += _flag_problems(words[3:], _script_sources(f"examples/{words[2]}.py", False))
        elif words[0] in ("python", "python3", ".venv/bin/python") and len(words) > 1:
            module = words[1] == "-m"
            program = words[2] if module else words[1]
            sources = _script_sources(program, module)
            if sources:
                problems += _flag_problems(words[2 + module :], sources)
    return problems


@pytest.mark.parametrize("block", NOT_RUN + COVERED, ids=_ids(NOT_RUN + COVERED))
def test_commands_that_do_not_run_here_name_what_exists(block: Block) -> None:
    """Paths, extras, examples and flags; ``covered-by`` names a test that exists."""
    problems = _problems(block) if block.language in ("bash", "console") else []
    covered = block.directive("covered-by")
    if covered is not None:
        path, _, name = covered.argument.partition("::")
        if not (ROOT / path).exists() or f"def {name}(" not in (ROOT / path).read_text():
            problems.append(f"covered-by names no test: {covered.argument}")
    assert not problems, f"{block.name}: " + "; ".join(problems)


def test_every_file_block_is_run_by_a_shell_block() -> None:
    """A ``file`` block no ``run`` block uses would never be executed."""
    unused = []
    for block in BLOCKS:
        written = block.directive("file")
        if written is None:
            continue
        runs = [
            b
            for b in SHELL_RUNS
            if b.path == block.path and b.line > block.line and written.argument in b.code
        ]
        if not runs:
            unused.append(f"{block.name}: {written.argument} is run by no shell block")
    assert not unused, "\n".join(unused)
