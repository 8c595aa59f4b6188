"""MkDocs hooks.

- ``benchmarks/RESULTS.md`` and the benchmarks' PNG charts go into the site from where the
  benchmarks write them, so no copy can go stale.
- Sphinx roles in docstrings (``:mod:`mirrored.comm.powersgd```), which Markdown leaves as text
  before the code span, are reduced to the code span.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
_SPHINX_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):(?=<code>)")


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


def on_page_content(html: str, **kwargs: Any) -> str:
    return _SPHINX_ROLE.sub("", html)
