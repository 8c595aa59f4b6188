"""TF_CONFIG parsed and checked: every rule, each with an error naming the field and the fix.

Pure unit tests: no environment, no socket. How a parsed TF_CONFIG becomes a rank is in
tests/test_cluster_resolver.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mirrored.cluster.tf_config import parse_tf_config


def tf_config(cluster: dict[str, Any], task_type: str = "worker", index: int = 0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_malformed_json_quotes_the_json_error():
    with pytest.raises(ValueError, match=r"TF_CONFIG is not valid JSON \(Expecting"):
        parse_tf_config("{'cluster': {}}", "TF_CONFIG")
    with pytest.raises(ValueError, match=r"^tf_config is not valid JSON \(Expecting value: line 1"):
        parse_tf_config("", "tf_config")


def test_tf_config_of_the_wrong_python_type_is_a_type_error():
    with pytest.raises(TypeError, match=r"tf_config=5: expected the TF_CONFIG JSON text, a dict"):
        parse_tf_config(5, "tf_config")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("[1, 2]", r"TF_CONFIG must be a JSON object with 'cluster' and 'task'; got list"),
        ('"worker"', r"must be a JSON object .* got str"),
        ('{"task": {"type": "worker", "index": 0}}', r"TF_CONFIG has no 'cluster'; add"),
        ('{"cluster": {"worker": ["h:1"]}}', r"TF_CONFIG has no 'task'; add this process"),
        (
            '{"cluster": ["h:1"], "task": {"type": "worker", "index": 0}}',
            r"TF_CONFIG\['cluster'\]=\['h:1'\]: expected an object of job name",
        ),
        (
            '{"cluster": {"worker": ["h:1"]}, "task": "worker"}',
            r"TF_CONFIG\['task'\]='worker': expected an object like",
        ),
        (
            '{"cluster": {"worker": ["h:1"]}, "task": {"index": 0}}',
            r"TF_CONFIG\['task'\] has no 'type'",
        ),
        (
            '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker"}}',
            r"TF_CONFIG\['task'\] has no 'index'",
        ),
    ],
)
def test_the_shape_of_tf_config_is_checked(config, match):
    with pytest.raises(ValueError, match=match):
        parse_tf_config(config, "TF_CONFIG")


@pytest.mark.parametrize(
    ("cluster", "task_type", "index", "match"),
    [
        (
            {"worker": ["h:1"], "master": ["m:1"], "foo": []},
            "worker",
            0,
            r"\['cluster'\] has unknown jobs \['foo', 'master'\]; the jobs are chief, worker, "
            r"ps, evaluator",
        ),
        ({"worker": "h:1"}, "worker", 0, r"\['cluster'\]\['worker'\]='h:1': expected a list"),
        ({"worker": ["h:1", 2]}, "worker", 0, r"\['worker'\]=\['h:1', 2\]: expected a list"),
        (
            {"chief": ["c:1", "d:1"], "worker": ["h:1"]},
            "chief",
            0,
            r"\['cluster'\]\['chief'\] has 2 tasks; a 'chief' job must have exactly one",
        ),
        ({"chief": [], "worker": ["h:1"]}, "worker", 0, r"\['chief'\] has 0 tasks"),
        (
            {"worker": ["h:1"], "evaluator": ["e:1", "e:2"]},
            "evaluator",
            0,
            r"\['evaluator'\] has 2 tasks; TensorFlow allows at most one evaluator",
        ),
        (
            {"ps": ["p:1"]},
            "ps",
            0,
            r"\['cluster'\] has no 'chief' and no 'worker' task; list at least one",
        ),
        ({"worker": []}, "worker", 0, r"no 'chief' and no 'worker' task"),
        (
            {"worker": ["h:1"]},
            "master",
            0,
            r"\['task'\]\['type'\]='master': expected one of chief, worker, ps, evaluator",
        ),
        (
            {"worker": ["h:1"]},
            "ps",
            0,
            r"\['task'\]\['type'\]='ps' is not a job of the cluster \(jobs: worker\); add its "
            r"addresses to cluster\['ps'\]",
        ),
        (
            {"worker": ["h:1"]},
            "chief",
            0,
            r"\['type'\]='chief' is not a job of the cluster",
        ),
        (
            {"worker": ["h:1", "h:2"]},
            "worker",
            2,
            r"\['task'\]\['index'\]=2 is out of range: job 'worker' has 2 tasks \(indices 0..1\)",
        ),
        (
            {"chief": ["c:1"], "worker": ["h:1"]},
            "chief",
            1,
            r"\['index'\]=1 is out of range: job 'chief' has 1 task \(indices 0..0\)",
        ),
        ({"worker": ["h:1"]}, "worker", -1, r"\['index'\]=-1 is out of range"),
        (
            {"worker": ["h:1"], "ps": []},
            "ps",
            0,
            r"\['index'\]=0 is out of range: job 'ps' has no tasks; fix the index or add",
        ),
        ({"worker": ["h:1"]}, "worker", "0", r"\['task'\]\['index'\]='0': expected an int"),
        ({"worker": ["h:1"]}, "worker", True, r"\['task'\]\['index'\]=True: expected an int"),
    ],
)
def test_the_cluster_and_task_are_checked(cluster, task_type, index, match):
    config = {"cluster": cluster, "task": {"type": task_type, "index": index}}
    with pytest.raises(ValueError, match=match):
        parse_tf_config(config, "tf_config")


@pytest.mark.parametrize(
    ("address", "match"),
    [
        ("host0", r"='host0' is not 'host:port'; e.g."),
        (":2222", r"=':2222' is not 'host:port'"),
        ("ho st:2222", r"='ho st:2222' is not 'host:port'"),
        ("http://h:1", r"='http://h:1' is not 'host:port'"),
        ("::1", r"='::1' is not 'host:port'"),
        ("fe80::1:2222", r"='fe80::1:2222': an IPv6 address must be in brackets"),
        ("::1:2222", r"='::1:2222': an IPv6 address must be in brackets, e.g. '\[::1\]:2222'"),
        ("[::1]2222", r"='\[::1\]2222' is not '\[ipv6\]:port'"),
        ("[not-ip]:2222", r"='\[not-ip\]:2222' is not '\[ipv6\]:port'"),
        ("[10.0.0.1]:2222", r"='\[10.0.0.1\]:2222' is not '\[ipv6\]:port'"),
        ("h:0", r"='h:0': the port must be a number in 1..65535"),
        ("h:65536", r"='h:65536': the port must be a number in 1..65535"),
        ("h:", r"='h:': the port must be a number"),
        ("h:22a", r"='h:22a': the port must be a number"),
        ("h:-1", r"='h:-1': the port must be a number"),
        ("[::1]:70000", r"='\[::1\]:70000': the port must be a number in 1..65535"),
    ],
)
def test_addresses_must_be_host_port(address, match):
    config = {"cluster": {"worker": ["h0:1", address]}, "task": {"type": "worker", "index": 0}}
    with pytest.raises(ValueError, match=r"^tf_config\['cluster'\]\['worker'\]\[1\]" + match):
        parse_tf_config(config, "tf_config")


def test_ports_at_the_ends_of_the_range_are_accepted():
    parsed = parse_tf_config(tf_config({"worker": ["h:1", "h:65535"]}, "worker", 1), "tf_config")
    assert parsed.cluster == {"worker": ["h:1", "h:65535"]}
    assert parsed.addresses == {("worker", 0): ("h", 1), ("worker", 1): ("h", 65535)}


@pytest.mark.parametrize(
    ("cluster", "match"),
    [
        (
            {"worker": ["h:1", "h:2", "h:1"]},
            r"worker 0 \('h:1'\) and worker 2 \('h:1'\) use the same address",
        ),
        (
            {"chief": ["h:1"], "worker": ["g:1"], "ps": ["H:1"]},
            r"chief 0 \('h:1'\) and ps 0 \('H:1'\) use the same address; give every task",
        ),
        (
            {"worker": ["[::1]:5", "[0:0::1]:5"]},
            r"worker 0 \('\[::1\]:5'\) and worker 1 \('\[0:0::1\]:5'\) use the same address",
        ),
        (
            {"worker": ["g:1"], "evaluator": ["10.0.0.1:9"], "ps": ["10.0.0.1:9"]},
            r"ps 0 \('10.0.0.1:9'\) and evaluator 0 \('10.0.0.1:9'\)",
        ),
    ],
)
def test_an_address_may_be_used_only_once(cluster, match):
    with pytest.raises(ValueError, match=match):
        parse_tf_config(tf_config(cluster, "worker", 0), "tf_config")
