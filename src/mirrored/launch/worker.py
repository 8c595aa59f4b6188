"""The worker side of ``mirrored launch``: run the program, say when it finished, and stop when the
launcher is gone. The launcher starts every worker as

    python -u -m mirrored.launch.worker [-m] PROGRAM [ARGS]

which runs PROGRAM as ``python -u [-m] PROGRAM ARGS`` would (``__main__``, ``sys.argv``,
``sys.path[0]``), in the same process. Two things torch's elastic agent cannot tell from a
worker's exit status are settled here:

- **A program that finished.** torch's teardown sometimes aborts a process after its program
  returned ("terminate called without an active exception", SIGABRT: 12 of 40 runs of plain gloo
  DDP on this project's hosts), and the agent then restarts a finished job or reports it failed.
  Once the program has returned (or called ``sys.exit(0)``) this module writes a marker,
  ``finished_marker(folder, attempt, rank)``; the launcher counts a worker with its marker as
  finished, whatever its exit status.
- **A launcher that is gone.** Workers run in sessions of their own, so a launcher killed with
  SIGKILL cannot stop them, and they would train to the end. A thread checks twice a second that
  the process's parent is still the launcher; once it is not, the worker's process group gets
  SIGTERM (as the launcher would send), then SIGKILL if it is still there 30 s later.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["FINISHED_DIR", "LAUNCHER_PID", "finished_marker", "main"]

FINISHED_DIR = "MIRRORED_FINISHED_DIR"  # where this launch's markers go
LAUNCHER_PID = "MIRRORED_LAUNCHER_PID"  # the process that started the workers
_WATCH_SECONDS = 0.5
_STOP_GRACE_SECONDS = 30.0  # torch's agent also waits 30 s between SIGTERM and SIGKILL


def finished_marker(folder: str, attempt: str, rank: str) -> str:
    """The file that says rank ``rank`` of attempt ``attempt`` (TORCHELASTIC_RESTART_COUNT)
    finished its program."""
    return os.path.join(folder, f"finished.{attempt}.{rank}")


def main(argv: Sequence[str]) -> None:
    if LAUNCHER_PID not in os.environ or not argv:
        raise SystemExit(
            "mirrored.launch.worker runs the workers of mirrored launch; run your script with "
            "mirrored launch [flags] SCRIPT [ARGS]"
        )
    as_module = argv[0] == "-m"
    program, *args = argv[1:] if as_module else argv
    _watch_launcher(int(os.environ[LAUNCHER_PID]))
    try:
        if as_module:  # as python -m: sys.path[0] stays the working directory
            sys.argv = [program, *args]  # run_module puts the module's path in sys.argv[0]
            runpy.run_module(program, run_name="__main__", alter_sys=True)
        else:  # as python SCRIPT: sys.path[0] is the script's directory
            path = os.path.abspath(program)  # as __main__.__file__ is since Python 3.9
            sys.argv = [path, *args]
            sys.path[0] = os.path.dirname(path)
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exit:
        if not exit.code:  # sys.exit(), sys.exit(0)
            _mark_finished()
        raise
    _mark_finished()


def _mark_finished() -> None:
    marker = finished_marker(
        os.environ[FINISHED_DIR], os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    )
    with open(marker, "w"):
        pass


def _watch_launcher(launcher_pid: int) -> None:
    """Stop this worker once its parent is no longer ``launcher_pid`` (the launcher died and
    the worker was handed to another parent)."""

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(_WATCH_SECONDS)
        print(
            f"mirrored launch: the launcher (process {launcher_pid}) is gone; stopping worker "
            f"rank {os.environ.get('RANK')} (process {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        _signal_own_processes(signal.SIGTERM)
        time.sleep(_STOP_GRACE_SECONDS)
        _signal_own_processes(signal.SIGKILL)

    threading.Thread(target=watch, name="mirrored-launcher-watch", daemon=True).start()


def _signal_own_processes(sig: signal.Signals) -> None:
    """``sig`` to this worker's process group (its data loaders too) when it leads one, as the
    launcher's workers do; else to this process alone."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), sig)
    else:
        os.kill(os.getpid(), sig)


if __name__ == "__main__":
    main(sys.argv[1:])
