"""The parser every example's command line starts from.

Its description is the first paragraph of the example's docstring, whole (its first line alone
stopped mid-sentence). Its program name is how the example was started, as argparse takes it
from ``sys.argv[0]``: ``mnist_mlp.py`` as a script or module, ``mirrored train mnist_mlp``
through the ``mirrored`` command, which sets ``sys.argv`` while an example runs.
"""

from __future__ import annotations

import argparse

__all__ = ["example_parser"]


def example_parser(doc: str | None, epilog: str | None = None) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first paragraph (``None`` under ``python -OO``)."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    description = " ".join(paragraph.replace("``", "").split())
    return argparse.ArgumentParser(description=description or None, epilog=epilog)
