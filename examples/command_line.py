"""The parser every example's command line starts from, and the help layout ``mirrored`` uses.

Its description is the first paragraph of the example's docstring, whole (its first line alone
stopped mid-sentence). Its program name is how the example was started, as argparse takes it
from ``sys.argv[0]``: ``mnist_mlp.py`` as a script or module, ``mirrored train mnist_mlp``
through the ``mirrored`` command, which sets ``sys.argv`` while an example runs.
"""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter", "example_parser"]


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, ``(default: 10)``, unless the help already
    names it in words (``default: 224 with --data, else 64``): an option without a value by
    default says in its help what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if (
            not action.option_strings
            or "default" in help_text.lower()
            or action.default in (None, argparse.SUPPRESS)
        ):
            return help_text
        return f"{help_text} (default: %(default)s)"


def example_parser(doc: str | None, epilog: str | None = None) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first paragraph (``None`` under ``python -OO``)."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    description = " ".join(paragraph.replace("``", "").split())
    return argparse.ArgumentParser(
        description=description or None, epilog=epilog, formatter_class=HelpFormatter
    )
