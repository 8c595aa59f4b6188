"""MkDocs hooks.

- ``benchmarks/RESULTS.md`` and the benchmarks' PNG charts go into the site from where the
  benchmarks write them, so no copy can go stale.
- Sphinx roles in docstrings (``:mod:`mirrored.comm.powersgd```), which Markdown leaves as text
  before the code span, are reduced to the code span.
- Inline code in table cells may break after a dot, an underscore or an opening parenthesis
  (``<wbr>``), so that a long name wraps as ``tf.distribute.`` / ``MirroredStrategy(devices)``
  rather than at whatever letter reaches the cell's edge.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
_SPHINX_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):(?=<code>)")
_TABLE_CELL = re.compile(r"<td\b[^>]*>.*?</td>", re.DOTALL)
_PLAIN_CODE = re.compile(r"<code>([^<]*)</code>")  # no tags inside: no attribute gets a <wbr>
_BREAK_POINT = re.compile(r"(?<=[._(])(?=[A-Za-z])")  # before a letter: not in 1800.0


def on_files(files: Files, config: Any) -> Files:
    for path in [ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "benchmarks").glob("*.png"))]:
        files.append(
            File(
                f"benchmarks/{path.name}",
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


def _code_break_points(cell: re.Match[str]) -> str:
    return _PLAIN_CODE.sub(
        lambda code: f"<code>{_BREAK_POINT.sub('<wbr>', code.group(1))}</code>", cell.group(0)
    )


def on_page_content(html: str, **kwargs: Any) -> str:
    return _TABLE_CELL.sub(_code_break_points, _SPHINX_ROLE.sub("", html))
