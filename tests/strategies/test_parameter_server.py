"""ParameterServerStrategy's checks of its cluster and arguments, before any process connects
(tests/multiprocess/test_parameter_server.py trains with real tasks)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mirrored.cluster.resolvers import TFConfigClusterResolver
from mirrored.strategies.parameter_server import ParameterServerStrategy


def _resolver(cluster: dict[str, list[str]], task: tuple[str, int] = ("chief", 0)) -> Any:
    return TFConfigClusterResolver(
        json.dumps({"cluster": cluster, "task": {"type": task[0], "index": task[1]}})
    )


@pytest.mark.parametrize(
    "cluster",
    [
        {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},  # no ps
        {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:3"]},  # ps without workers
        {"worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},  # no chief to coordinate
    ],
)
def test_a_cluster_without_chief_workers_and_ps_is_refused(cluster: dict[str, list[str]]) -> None:
    with pytest.raises(ValueError, match="needs one 'chief', at least one 'worker'"):
        ParameterServerStrategy(_resolver(cluster, (next(iter(cluster)), 0)))


def test_a_duplicate_address_is_refused_by_the_resolver() -> None:
    with pytest.raises(ValueError, match=r"127\.0\.0\.1:2"):
        _resolver({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:2"]})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_staleness": -1}, "max_staleness=-1"),
        ({"max_staleness": 1.5}, "max_staleness=1.5"),
        ({"timeout_seconds": 0}, "timeout_seconds=0"),
        ({"synchronous": True, "max_staleness": 2}, "synchronous=True .* max_staleness=2"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    with pytest.raises(ValueError, match=message):
        ParameterServerStrategy(_resolver(cluster), **kwargs)


def test_the_evaluator_is_told_it_takes_no_part() -> None:
    cluster = {
        "chief": ["127.0.0.1:1"],
        "worker": ["127.0.0.1:2"],
        "ps": ["127.0.0.1:3"],
        "evaluator": ["127.0.0.1:4"],
    }
    with pytest.raises(ValueError, match="evaluator task takes no part"):
        ParameterServerStrategy(_resolver(cluster, ("evaluator", 0)))
