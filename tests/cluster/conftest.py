"""The plain run of tests/cluster/cluster_program.py, which the SLURM and Ray runs end equal to."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.cluster_program import COMMAND, plain_env, results
from tests.multiprocess.spawn import assert_all_succeeded, start_process, wait_workers


@pytest.fixture(scope="session")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The program run with plain ``python``: one process, one worker."""
    out = tmp_path_factory.mktemp("plain")
    assert_all_succeeded(wait_workers([start_process([*COMMAND, str(out)], plain_env())], 120))
    (result,) = results(out, 1)
    assert (result["resolver"], result["world_size"]) == ("LocalClusterResolver", 1)
    return result
