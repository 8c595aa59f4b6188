"""Cluster resolvers: TF_CONFIG and torchrun's environment -> rank, world size, rendezvous.

Pure unit tests: every environment is passed as ``environ=``, os.environ is never touched.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from mirrored.cluster.resolvers import (
    ClusterResolver,
    LocalClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    resolve_cluster,
)


def tf_config(cluster: dict[str, Any], task_type: str = "worker", index: int = 0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


WORKERS = {"worker": ["host0:2222", "host1:2222", "host2:2222"]}
WITH_CHIEF = {
    "chief": ["chief:2222"],
    "worker": ["host0:2222", "host1:2222"],
    "ps": ["ps0:2222", "ps1:2222"],
    "evaluator": ["eval:2222"],
}


def torchrun_env(**overrides: str) -> dict[str, str]:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    env.update(overrides)
    return env


# --- TF_CONFIG ------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 1, 2])
def test_without_a_chief_worker_0_is_the_chief(index):
    r = TFConfigClusterResolver(tf_config(WORKERS, "worker", index))
    assert (r.task_type, r.task_id, r.rank, r.world_size) == ("worker", index, index, 3)
    assert (r.master_addr, r.master_port) == ("host0", 2222)
    assert r.is_chief == (index == 0)
    assert r.local_rank == 0  # every worker on its own host
    assert (r.agent_store, r.restart_count) == (False, 0)
    assert r.cluster_spec() == WORKERS


def test_with_a_chief_it_is_rank_0_and_worker_i_is_rank_i_plus_1():
    chief = TFConfigClusterResolver(tf_config(WITH_CHIEF, "chief", 0))
    assert (chief.rank, chief.world_size, chief.is_chief) == (0, 3, True)
    assert (chief.master_addr, chief.master_port) == ("chief", 2222)
    for index in (0, 1):
        worker = TFConfigClusterResolver(tf_config(WITH_CHIEF, "worker", index))
        assert (worker.task_type, worker.task_id) == ("worker", index)
        assert (worker.rank, worker.world_size, worker.is_chief) == (index + 1, 3, False)
        assert (worker.master_addr, worker.master_port) == ("chief", 2222)


@pytest.mark.parametrize(("task_type", "index"), [("ps", 0), ("ps", 1), ("evaluator", 0)])
def test_ps_and_evaluator_tasks_are_not_synchronous_workers(task_type, index):
    r = TFConfigClusterResolver(tf_config(WITH_CHIEF, task_type, index))
    assert (r.task_type, r.task_id, r.rank, r.local_rank) == (task_type, index, -1, 0)
    assert r.world_size == 3 and not r.is_chief
    assert (r.master_addr, r.master_port) == ("chief", 2222)


def test_the_evaluator_may_be_left_out_of_the_cluster_as_in_tensorflow():
    r = TFConfigClusterResolver(tf_config(WORKERS, "evaluator", 0))
    assert (r.rank, r.world_size, r.task_type) == (-1, 3, "evaluator")
    with pytest.raises(ValueError, match=r"\['index'\]=-1: expected an int >= 0"):
        TFConfigClusterResolver(tf_config(WORKERS, "evaluator", -1))


def test_local_rank_counts_earlier_workers_on_the_same_host():
    cluster = {
        "chief": ["a:1000"],
        "worker": ["a:1001", "b:1000", "A:1002", "b:1001"],
        "ps": ["a:2000"],  # not a worker: not counted
    }
    local_ranks = [TFConfigClusterResolver(tf_config(cluster, "chief")).local_rank] + [
        TFConfigClusterResolver(tf_config(cluster, "worker", i)).local_rank for i in range(4)
    ]
    assert local_ranks == [0, 1, 0, 2, 1]  # host names compare case-insensitively
    local_sizes = [TFConfigClusterResolver(tf_config(cluster, "chief")).local_world_size] + [
        TFConfigClusterResolver(tf_config(cluster, "worker", i)).local_world_size for i in range(4)
    ]
    assert local_sizes == [3, 3, 2, 3, 2]
    ps = TFConfigClusterResolver(tf_config(cluster, "ps", 0))
    assert (ps.local_rank, ps.local_world_size) == (0, 1)


def test_ipv6_addresses_are_bracketed_in_the_config_and_bare_in_master_addr():
    cluster = {"worker": ["[::1]:2222", "[::1]:2223", "[fe80::1%eth0]:2222", "10.0.0.1:2222"]}
    r = TFConfigClusterResolver(tf_config(cluster, "worker", 1))
    assert (r.master_addr, r.master_port, r.rank, r.local_rank) == ("::1", 2222, 1, 1)
    assert r.cluster_spec() == cluster


def test_a_dict_is_accepted_and_not_modified():
    config = {"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 1}}
    before = json.dumps(config)
    r = TFConfigClusterResolver(config)
    assert (r.rank, r.world_size) == (1, 2)
    assert json.dumps(config) == before


def test_unknown_top_level_keys_are_ignored_as_in_tensorflow():
    config = json.loads(tf_config(WORKERS))
    config.update(environment="cloud", rpc_layer="grpc")
    assert TFConfigClusterResolver(config).world_size == 3


def test_tf_config_is_read_from_the_given_environ():
    env = {"TF_CONFIG": tf_config(WITH_CHIEF, "worker", 1)}
    r = TFConfigClusterResolver(environ=env)
    assert (r.rank, r.master_addr) == (2, "chief")


@pytest.mark.parametrize("env", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  "}])
def test_a_missing_tf_config_is_an_error(env):
    with pytest.raises(ValueError, match=r"TF_CONFIG is not set .* or pass tf_config="):
        TFConfigClusterResolver(environ=env)


def test_cluster_spec_is_a_copy():
    r = TFConfigClusterResolver(tf_config(WITH_CHIEF, "chief"))
    spec = r.cluster_spec()
    spec["worker"].append("intruder:1")
    spec["extra"] = []
    assert r.cluster_spec() == WITH_CHIEF


def test_repr_names_the_class_and_fields():
    r = TFConfigClusterResolver(tf_config(WITH_CHIEF, "worker", 1))
    assert repr(r) == (
        "TFConfigClusterResolver(task_type='worker', task_id=1, rank=2, world_size=3, "
        "master_addr='chief', master_port=2222, local_rank=0, local_world_size=1, "
        "agent_store=False, restart_count=0)"
    )


def test_errors_name_the_source_of_tf_config():
    with pytest.raises(ValueError, match=r"^TF_CONFIG is not valid JSON \(Expecting"):
        TFConfigClusterResolver(environ={"TF_CONFIG": "{'cluster': {}}"})
    with pytest.raises(ValueError, match=r"^tf_config\['cluster'\]\['worker'\]\[0\]='h'"):
        TFConfigClusterResolver(tf_config({"worker": ["h"]}))


# --- torchrun --------------------------------------------------------------------------------


def test_torchrun_variables():
    r = TorchrunClusterResolver(torchrun_env())
    assert (r.task_type, r.task_id, r.rank, r.world_size, r.local_rank) == ("worker", 1, 1, 4, 1)
    assert (r.master_addr, r.master_port) == ("10.0.0.1", 29500)
    assert (r.agent_store, r.restart_count, r.is_chief) == (False, 0, False)
    assert r.cluster_spec() == {}
    assert TorchrunClusterResolver(torchrun_env(RANK="0")).is_chief


def test_torchrun_with_mirrored_num_ps_is_a_parameter_server_cluster():
    tasks = [
        TorchrunClusterResolver(torchrun_env(RANK=str(rank), MIRRORED_NUM_PS="1"))
        for rank in range(4)
    ]
    assert [(r.task_type, r.task_id, r.rank) for r in tasks] == [
        ("chief", 0, 0),
        ("worker", 0, 1),
        ("worker", 1, 2),
        ("ps", 0, -1),
    ]
    assert all(
        r.cluster_spec()
        == {"chief": ["10.0.0.1:29500"], "worker": ["rank1", "rank2"], "ps": ["rank3"]}
        for r in tasks
    )
    with pytest.raises(ValueError, match=r"MIRRORED_NUM_PS=3 with WORLD_SIZE=4: .* at least 5"):
        TorchrunClusterResolver(torchrun_env(MIRRORED_NUM_PS="3"))


def test_torchrun_local_world_size():
    assert TorchrunClusterResolver(torchrun_env(LOCAL_WORLD_SIZE="2")).local_world_size == 2
    assert TorchrunClusterResolver(torchrun_env()).local_world_size == 2  # LOCAL_RANK 1 + 1
    with pytest.raises(ValueError, match=r"local_world_size=1: expected an int above local_rank"):
        TorchrunClusterResolver(torchrun_env(LOCAL_WORLD_SIZE="1"))


def test_torchrun_elastic_variables():
    env = torchrun_env(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="3")
    r = TorchrunClusterResolver(env)
    assert (r.agent_store, r.restart_count) == (True, 3)
    for value in ("False", "true", "1", ""):  # torch compares with str(True) exactly
        env = torchrun_env(TORCHELASTIC_USE_AGENT_STORE=value)
        assert TorchrunClusterResolver(env).agent_store is False


def test_torchrun_defaults():
    r = TorchrunClusterResolver({"RANK": "0", "WORLD_SIZE": "1"})
    assert (r.local_rank, r.master_addr, r.master_port) == (0, "127.0.0.1", 0)
    assert (r.agent_store, r.restart_count, r.is_chief) == (False, 0, True)
    env = torchrun_env()
    del env["LOCAL_RANK"], env["MASTER_ADDR"]
    r = TorchrunClusterResolver(env)
    assert (r.local_rank, r.master_addr, r.master_port) == (0, "127.0.0.1", 29500)


@pytest.mark.parametrize(
    ("value", "host"), [("[::1]", "::1"), ("fd00::2", "fd00::2"), ("n-1", "n-1")]
)
def test_torchrun_master_addr_forms(value, host):
    assert TorchrunClusterResolver(torchrun_env(MASTER_ADDR=value)).master_addr == host


def test_torchrun_accepts_surrounding_whitespace_in_integers():
    assert TorchrunClusterResolver(torchrun_env(RANK=" 2 ")).rank == 2


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE"])
def test_torchrun_requires_rank_and_world_size(name):
    env = torchrun_env()
    del env[name]
    with pytest.raises(ValueError, match=rf"^{name} is not set; launchers \(torchrun"):
        TorchrunClusterResolver(env)


@pytest.mark.parametrize(
    "name",
    ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"],
)
@pytest.mark.parametrize("value", ["x", "1.5", "", "1_0", "+1"])
def test_torchrun_integers_must_be_integers(name, value):
    with pytest.raises(
        ValueError, match=rf"^{name}='{re.escape(value)}' is not an integer; set it"
    ):
        TorchrunClusterResolver(torchrun_env(**{name: value}))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"WORLD_SIZE": "0", "RANK": "0"}, r"^WORLD_SIZE='0': the number of workers must be >= 1"),
        ({"WORLD_SIZE": "-2"}, r"^WORLD_SIZE='-2': the number of workers must be >= 1"),
        ({"RANK": "4"}, r"^RANK='4' is outside 0..WORLD_SIZE-1 \(WORLD_SIZE=4\); each worker"),
        ({"RANK": "-1"}, r"^RANK='-1' is outside 0..WORLD_SIZE-1"),
        ({"LOCAL_RANK": "4"}, r"^LOCAL_RANK='4' is outside 0..WORLD_SIZE-1 \(WORLD_SIZE=4\)"),
        ({"LOCAL_RANK": "-1"}, r"^LOCAL_RANK='-1' is outside"),
        ({"MASTER_PORT": "0"}, r"^MASTER_PORT='0' is outside 1..65535 \(WORLD_SIZE=4\); set it"),
        ({"MASTER_PORT": "65536"}, r"^MASTER_PORT='65536' is outside 1..65535"),
        (
            {"MASTER_PORT": "65536", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"},
            r"^MASTER_PORT='65536' is outside 0..65535 \(WORLD_SIZE=1\)",
        ),
        ({"MASTER_ADDR": ""}, r"^MASTER_ADDR='' is not a host name or IP address; set it"),
        ({"MASTER_ADDR": "a b"}, r"^MASTER_ADDR='a b' is not a host name"),
        ({"MASTER_ADDR": "[nope]"}, r"^MASTER_ADDR='\[nope\]' is not a host name"),
        (
            {"TORCHELASTIC_RESTART_COUNT": "-1"},
            r"^TORCHELASTIC_RESTART_COUNT='-1': expected an int >= 0",
        ),
    ],
)
def test_torchrun_values_are_checked(overrides, match):
    with pytest.raises(ValueError, match=match):
        TorchrunClusterResolver(torchrun_env(**overrides))


def test_torchrun_needs_master_port_for_more_than_one_worker():
    env = torchrun_env()
    del env["MASTER_PORT"]
    with pytest.raises(ValueError, match=r"^MASTER_PORT is not set but WORLD_SIZE=4; set it"):
        TorchrunClusterResolver(env)


def test_torchrun_single_worker_may_use_port_0():
    r = TorchrunClusterResolver({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "0"})
    assert r.master_port == 0


# --- local and the base class ----------------------------------------------------------------


def test_local_is_one_worker_on_any_free_port():
    r = LocalClusterResolver()
    assert (r.task_type, r.task_id, r.rank, r.world_size, r.local_rank) == ("worker", 0, 0, 1, 0)
    assert (r.master_addr, r.master_port, r.agent_store, r.restart_count) == (
        "127.0.0.1",
        0,
        False,
        0,
    )
    assert r.is_chief and r.cluster_spec() == {}
    assert repr(r).startswith("LocalClusterResolver(task_type='worker', task_id=0, rank=0,")


BASE: dict[str, Any] = dict(
    task_type="worker", task_id=0, rank=0, world_size=2, master_addr="h", master_port=1
)


def test_the_base_class_can_be_built_directly():
    spec = {"worker": ["h:1", "g:1"]}
    r = ClusterResolver(**{**BASE, "cluster_spec": spec, "agent_store": True, "restart_count": 2})
    assert (r.rank, r.world_size, r.agent_store, r.restart_count) == (0, 2, True, 2)
    assert r.cluster_spec() == spec and r.cluster_spec() is not spec
    assert ClusterResolver(**{**BASE, "task_type": "ps", "rank": -1}).rank == -1


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"task_type": "master"}, r"^task_type='master': expected one of chief, worker"),
        ({"world_size": 0}, r"^world_size=0: expected an int >= 1"),
        ({"world_size": True}, r"^world_size=True: expected an int >= 1"),
        ({"task_id": -1}, r"^task_id=-1: expected an int >= 0"),
        ({"rank": 2}, r"^rank=2 is outside 0..world_size-1 \(1\)"),
        ({"rank": -1}, r"^rank=-1 is outside 0..world_size-1"),
        ({"task_type": "evaluator"}, r"^rank=0 for a 'evaluator' task: .* pass rank=-1"),
        ({"master_addr": ""}, r"^master_addr='': expected a non-empty host name"),
        ({"master_addr": "[::1]"}, r"^master_addr='\[::1\]': .*IPv6 without brackets"),
        ({"master_port": 65536}, r"^master_port=65536: expected an int in 0..65535"),
        ({"master_port": 0}, r"^master_port=0 with world_size=2: only a single worker"),
        ({"local_rank": -1}, r"^local_rank=-1: expected an int >= 0"),
        ({"restart_count": -1}, r"^restart_count=-1: expected an int >= 0"),
    ],
)
def test_the_base_class_checks_its_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        ClusterResolver(**{**BASE, **overrides})


# --- resolve_cluster -------------------------------------------------------------------------


def test_resolve_prefers_the_launcher():
    r = resolve_cluster(torchrun_env())
    assert isinstance(r, TorchrunClusterResolver) and r.rank == 1


def test_resolve_uses_tf_config_without_a_launcher():
    r = resolve_cluster({"TF_CONFIG": tf_config(WITH_CHIEF, "worker", 0)})
    assert isinstance(r, TFConfigClusterResolver) and (r.rank, r.world_size) == (1, 3)


@pytest.mark.parametrize("env", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": " \n"}, {"OTHER": "1"}])
def test_resolve_falls_back_to_one_local_worker(env):
    assert isinstance(resolve_cluster(env), LocalClusterResolver)


def test_resolve_accepts_a_tf_config_that_agrees_with_world_size():
    env = torchrun_env(WORLD_SIZE="3", RANK="2", TF_CONFIG=tf_config(WITH_CHIEF, "worker", 0))
    r = resolve_cluster(env)
    assert isinstance(r, TorchrunClusterResolver) and r.rank == 2  # the launcher's rank wins


def test_resolve_refuses_a_tf_config_that_disagrees_with_world_size():
    env = torchrun_env(TF_CONFIG=tf_config(WITH_CHIEF, "worker", 0))
    with pytest.raises(ValueError, match=r"^WORLD_SIZE=4 but TF_CONFIG describes 3 synchronous"):
        resolve_cluster(env)


def test_resolve_reports_a_bad_tf_config_beside_the_launcher():
    with pytest.raises(ValueError, match=r"TF_CONFIG is not valid JSON"):
        resolve_cluster(torchrun_env(TF_CONFIG="{"))


def test_resolve_reports_bad_launcher_variables():
    with pytest.raises(ValueError, match=r"^RANK='9' is outside"):
        resolve_cluster(torchrun_env(RANK="9", TF_CONFIG=tf_config(WORKERS)))


@pytest.mark.parametrize(("present", "missing"), [("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")])
def test_resolve_refuses_half_a_launcher_environment(present, missing):
    env = {present: "0", "TF_CONFIG": tf_config(WORKERS)}
    with pytest.raises(ValueError, match=rf"^{present}='0' is set but {missing} is not; set both"):
        resolve_cluster(env)
