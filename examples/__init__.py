"""The users' programs (MISSION.md), runnable as scripts (``python examples/NAME.py --help``),
as modules (``python -m mirrored.examples.NAME``) and through ``mirrored train NAME``."""
