"""Runs documentation programs one after another in this process, each as a fresh script.

Usage: python run_programs.py PROGRAMS.json RESULTS.json. Each program is a list of pieces
(name, first line, code) run in one ``__main__`` namespace, in a folder of its own, with the
device configuration forgotten before it (as in a new process) and optionally logical CPU devices
set up first. One process for a page's programs saves importing torch for each of them.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import io
import json
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from types import CodeType, FrameType

import torch

from mirrored import config

TIMEOUT_SECONDS = 120


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise TimeoutError(f"the program ran longer than {TIMEOUT_SECONDS} s")


def _compiled(name: str, first_line: int, code: str) -> CodeType:
    """Code whose tracebacks name the page and its line."""
    tree = ast.parse(code, filename=name.rsplit(":", 1)[0])
    ast.increment_lineno(tree, first_line - 1)
    return compile(tree, name.rsplit(":", 1)[0], "exec")


def run(program: dict) -> dict:
    config._reset_for_tests()
    if program["logical_cpus"]:
        config.set_logical_device_configuration(
            config.list_physical_devices("CPU")[0],
            [config.LogicalDeviceConfiguration()] * program["logical_cpus"],
        )
    namespace = {"__name__": "__main__"}
    output = io.StringIO()
    environ, threads, cwd = dict(os.environ), torch.get_num_threads(), os.getcwd()
    error = None
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        signal.alarm(TIMEOUT_SECONDS)
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                for name, first_line, code in program["pieces"]:
                    exec(_compiled(name, first_line, code), namespace)
        except BaseException:  # a snippet's SystemExit too
            error = traceback.format_exc()
        finally:
            signal.alarm(0)
            os.chdir(cwd)
            namespace.clear()
            gc.collect()  # ends the replica threads of a strategy left open
            os.environ.clear()
            os.environ.update(environ)
            torch.set_num_threads(threads)
    return {"output": output.getvalue(), "error": error}


def main() -> None:
    programs = json.loads(Path(sys.argv[1]).read_text())
    signal.signal(signal.SIGALRM, _on_alarm)
    Path(sys.argv[2]).write_text(json.dumps([run(program) for program in programs]))


if __name__ == "__main__":
    main()
