"""MkDocs hooks: put benchmarks/RESULTS.md and the benchmarks' PNG charts into the site.

They stay where the benchmarks write them; the site reads them from there (as
``benchmarks/RESULTS.md`` and ``benchmarks/*.png``), so no copy can go stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


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
