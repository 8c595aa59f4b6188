"""The code blocks of README.md and docs/, and what the tests do with each.

A fenced block may be preceded by HTML comments (invisible on the rendered page) that say how
it is tested, one ``<!-- test: KIND ... -->`` each:

- a ``python`` block with no comment runs as a program of its own;
- ``continue``: the block runs after the page's previous python program, in its namespace;
- ``prelude`` followed by code lines up to ``-->``: hidden code run before the block (the data
  or model the text calls "yours");
- ``file NAME``: the block is written to NAME in the page's working folder, for a shell block;
- ``run``: a shell block runs with bash in that folder (``run multiprocess`` when it starts
  several processes);
- ``same-output``: a ``diff`` block's two sides run, the new one on 2 logical CPU devices, and
  must print the same numbers;
- ``not-run REASON``: a shell block that cannot run here (an install, GPUs, several machines, a
  long benchmark); its paths, extras, examples and flags are checked against the repository;
- ``covered-by tests/PATH::NAME``: another test runs exactly this block's content;
- ``tensorflow``: a ``python`` block of TensorFlow code shown beside ours for comparison (the
  tutorials under docs/migrating/): never run, only parsed, since TensorFlow is not installed.

``python``, ``diff``, ``bash`` and ``console`` fences are code; ``text`` fences show output.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_LANGUAGES = {"python", "diff", "bash", "console"}
OTHER_LANGUAGES = {"text", "yaml", "json", "toml"}
KINDS = {
    "continue",
    "prelude",
    "file",
    "run",
    "same-output",
    "not-run",
    "covered-by",
    "tensorflow",
}

_FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)\s*$")
_DIRECTIVE = re.compile(r"<!-- test: (?P<kind>[\w-]+)(?P<rest>.*?)(?:-->|$)", re.DOTALL)


@dataclass
class Directive:
    kind: str
    argument: str = ""  # the rest of the first line
    body: str = ""  # the following lines (a prelude's code)


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    language: str
    code: str
    directives: list[Directive] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def directive(self, kind: str) -> Directive | None:
        return next((d for d in self.directives if d.kind == kind), None)


def documentation_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _directives_above(lines: list[str], fence: int) -> list[Directive]:
    """The ``<!-- test: ... -->`` comments directly above line ``fence`` (blank lines allowed)."""
    found: list[Directive] = []
    end = fence - 1
    while True:
        while end >= 0 and not lines[end].strip():
            end -= 1
        if end < 0 or not lines[end].rstrip().endswith("-->"):
            return found
        start = end
        while start >= 0 and "<!--" not in lines[start]:
            start -= 1
        match = _DIRECTIVE.search("\n".join(lines[start : end + 1]))
        if start < 0 or match is None:
            return found
        first, _, body = match["rest"].partition("\n")
        # Inside a content tab the comment is indented with its fence: a prelude's code is not.
        body = textwrap.dedent(body.rstrip().removesuffix("-->"))
        found.insert(0, Directive(match["kind"], first.strip(), body))
        end = start - 1


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent = len(opening["indent"])
        closing = next(
            (
                j
                for j in range(index + 1, len(lines))
                if lines[j].strip() == "```" and lines[j].startswith(opening["indent"])
            ),
            None,
        )
        if closing is None:
            raise ValueError(f"{path}:{index + 1}: a code fence that never closes")
        code = "\n".join(line[indent:] for line in lines[index + 1 : closing]) + "\n"
        found.append(Block(path, index + 2, opening["lang"], code, _directives_above(lines, index)))
        index = closing + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in documentation_pages() for block in blocks(page)]


@dataclass
class Program:
    """Python run in one namespace: the pieces in order, each (block name, first line, code)."""

    page: Path
    pieces: list[tuple[str, int, str]]
    blocks: list[Block]
    logical_cpus: int | None = None  # configure this many logical CPU devices first

    @property
    def name(self) -> str:
        return self.blocks[-1].name


def python_programs(page_blocks: list[Block]) -> list[Program]:
    """A page's python programs: each block, joined to the one before it where it continues."""
    programs: list[Program] = []
    for block in page_blocks:
        if block.language != "python" or any(
            block.directive(kind) for kind in ("file", "covered-by", "tensorflow")
        ):
            continue
        pieces = []
        prelude = block.directive("prelude")
        if prelude is not None:
            pieces.append((f"{block.name} (prelude)", 1, prelude.body.strip("\n") + "\n"))
        pieces.append((block.name, block.line, block.code))
        if block.directive("continue"):
            if not programs:
                raise ValueError(f"{block.name}: 'continue' with no program before it")
            previous = programs.pop()
            programs.append(
                Program(block.path, previous.pieces + pieces, [*previous.blocks, block])
            )
        else:
            programs.append(Program(block.path, pieces, [block]))
    return programs


def diff_sides(diff: str) -> tuple[str, str]:
    """The old and new text of a diff without headers: context lines go to both sides."""
    old, new = [], []
    for line in diff.splitlines():
        if line.startswith(("--- ", "+++ ", "@@")):
            continue
        marker, text = line[:1], line[1:]
        if marker in (" ", ""):
            old.append(text)
            new.append(text)
        elif marker == "-":
            old.append(text)
        elif marker == "+":
            new.append(text)
        else:
            raise ValueError(f"not a diff line: {line!r}")
    return "\n".join(old) + "\n", "\n".join(new) + "\n"
