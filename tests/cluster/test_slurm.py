"""SLURM: host lists, task counts, the resolver of an srun step, and real runs.

The unit tests pass every environment as ``environ=``. ``SRUN_TASK_0`` is what ``srun -n 2``
set in task 0 on a one-node SLURM 22.05 (slurmctld and slurmd from Debian's packages, node
``vm`` at 127.0.0.1), printed by ``env``; the other environments differ from it as srun(1)'s
OUTPUT ENVIRONMENT VARIABLES say. The last two tests train for real: two processes given the
variables of a two-task step, and ``srun`` itself where a SLURM controller answers.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import socket
import subprocess

import pytest

from mirrored.cluster.resolvers import (
    LocalClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    resolve_cluster,
)
from mirrored.cluster.slurm import (
    MAX_HOSTS,
    PORT_BASE,
    expand_hostlist,
    expand_tasks_per_node,
    read_step,
)
from tests.cluster.cluster_program import COMMAND, assert_trained_as_one_process, plain_env
from tests.multiprocess.spawn import REPO, assert_all_succeeded, start_process, wait_workers

SRUN_TASK_0 = {
    "SLURMD_NODENAME": "vm",
    "SLURM_CLUSTER_NAME": "local",
    "SLURM_CONF": "/etc/slurm/slurm.conf",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_GTIDS": "0,1",
    "SLURM_JOBID": "1",
    "SLURM_JOB_CPUS_PER_NODE": "2",
    "SLURM_JOB_GID": "0",
    "SLURM_JOB_ID": "1",
    "SLURM_JOB_NAME": "bash",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_JOB_UID": "0",
    "SLURM_JOB_USER": "root",
    "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "vm",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_PRIO_PROCESS": "0",
    "SLURM_PROCID": "0",
    "SLURM_SRUN_COMM_HOST": "127.0.0.1",
    "SLURM_SRUN_COMM_PORT": "33235",
    "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_LAUNCHER_PORT": "33235",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_SUBMIT_DIR": "/tmp",
    "SLURM_SUBMIT_HOST": "vm",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_TASK_PID": "5037",
    "SLURM_TOPOLOGY_ADDR": "vm",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
    "SLURM_UMASK": "0022",
    "SLURM_WORKING_CLUSTER": "local:127.0.0.1:6817:9728:109",
}
# The batch script of `sbatch -n 2` and an `salloc -n 2` shell on the same SLURM: no step.
SBATCH_SCRIPT = {
    "SLURM_JOB_ID": "2",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_LOCALID": "0",
    "SLURM_NODELIST": "vm",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_TASKS_PER_NODE": "2",
}
SALLOC_SHELL = {"SLURM_JOB_ID": "3", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "vm"}


def srun_task(rank: int = 0, **overrides: str) -> dict[str, str]:
    """Task ``rank`` of the one-node, two-task step (its local id is its rank)."""
    return {**SRUN_TASK_0, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), **overrides}


def three_node_task(rank: int, **overrides: str) -> dict[str, str]:
    """Task ``rank`` of ``srun -N 3 -n 7`` by block: 3 tasks on node01, 2 on node02, 2 on node07."""
    node = [0, 0, 0, 1, 1, 2, 2][rank]
    return {
        **SRUN_TASK_0,
        "SLURM_STEP_NODELIST": "node[01-02,07]",
        "SLURM_STEP_TASKS_PER_NODE": "3,2(x2)",
        "SLURM_STEP_NUM_TASKS": "7",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "3",
        "SLURM_PROCID": str(rank),
        "SLURM_NODEID": str(node),
        "SLURM_LOCALID": str(rank - [0, 3, 5][node]),
        **overrides,
    }


# --- host lists and task counts --------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("vm", ["vm"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # the first bound's width
        ("n[01-3]", ["n01", "n02", "n03"]),
        ("n[1-03]", ["n1", "n2", "n3"]),
        ("n[1-3]-ib", ["n1-ib", "n2-ib", "n3-ib"]),
        ("rack[1-2]n[01-02]", ["rack1n01", "rack1n02", "rack2n01", "rack2n02"]),
        ("n[1-2]-[3-4],m1", ["n1-3", "n1-4", "n2-3", "n2-4", "m1"]),
        ("n[1,1]", ["n1", "n1"]),
        ("n[0]", ["n0"]),
        ("[1-2]", ["1", "2"]),
        ("gnode[10,20,25,37]", ["gnode10", "gnode20", "gnode25", "gnode37"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
        (" vm\n", ["vm"]),
    ],
)
def test_host_lists_expand_as_scontrol_show_hostnames_prints_them(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "problem"),
    [
        ("", "is empty"),
        ("  ", "is empty"),
        ("a b", "contains whitespace"),
        ("n[1 -2]", "contains whitespace"),
        ("a[1-2", "has unpaired or nested brackets"),
        ("a]1", "has unpaired or nested brackets"),
        ("n[[1-2]]", "has unpaired or nested brackets"),
        ("a,,b", "has an empty entry"),
        ("n[1-2],", "has an empty entry"),
        (",a", "has an empty entry"),
        ("n[]", r"has \[\], which is not numbers and ranges"),
        ("n[a-b]", r"has \[a-b\], which is not numbers and ranges"),
        ("n[1-]", r"has \[1-\], which is not numbers and ranges"),
        ("n[-1]", r"has \[-1\], which is not numbers and ranges"),
        ("n[3-1]", "has the backward range '3-1'"),
        (f"n[0-{MAX_HOSTS}]", f"names more than {MAX_HOSTS} hosts"),
        (f"a[1-{MAX_HOSTS // 2}]b[1-3]", f"names more than {MAX_HOSTS} hosts"),
        ("n[0-99999999999999]", f"names more than {MAX_HOSTS} hosts"),  # refused at once
    ],
)
def test_malformed_host_lists_are_refused_naming_the_variable(hostlist, problem):
    start = rf"^SLURM_STEP_NODELIST={re.escape(repr(hostlist))} {problem}"
    with pytest.raises(ValueError, match=start) as error:
        expand_hostlist(hostlist, "SLURM_STEP_NODELIST")
    assert "e.g. 'node[01-04,07],login1'" in str(error.value)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("1(x4)", [1, 1, 1, 1]), ("3,2(x2)", [3, 2, 2])],
)
def test_tasks_per_node_expand_the_repeat_counts(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "0", "2(x0)", "2x3", "2(x3", "(x2)", "a", "1,,2", "-1"])
def test_malformed_tasks_per_node_are_refused(text):
    with pytest.raises(ValueError, match=r"^SLURM_STEP_TASKS_PER_NODE=.* is not a task count; "):
        expand_tasks_per_node(text, "SLURM_STEP_TASKS_PER_NODE")


# --- the resolver ----------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_the_tasks_of_a_one_node_step_meet_on_that_node(rank):
    r = SlurmClusterResolver(environ=srun_task(rank))
    assert (r.task_type, r.task_id, r.rank, r.world_size) == ("worker", rank, rank, 2)
    assert (r.local_rank, r.local_world_size) == (rank, 2)
    assert (r.master_addr, r.master_port) == ("vm", PORT_BASE + 10)  # job 1, step 0
    assert r.is_chief == (rank == 0) and r.cluster_spec() == {}
    assert r.visible_gpus_shared and r.gpus_per_task == 0


@pytest.mark.parametrize(
    ("rank", "local_rank", "local_world_size"),
    [(0, 0, 3), (2, 2, 3), (3, 0, 2), (4, 1, 2), (6, 1, 2)],
)
def test_the_tasks_of_a_three_node_step(rank, local_rank, local_world_size):
    r = SlurmClusterResolver(environ=three_node_task(rank))
    assert (r.rank, r.world_size, r.local_rank, r.local_world_size) == (
        rank,
        7,
        local_rank,
        local_world_size,
    )
    assert (r.master_addr, r.master_port) == ("node01", PORT_BASE + 456 * 10 + 3)


def test_every_task_of_a_step_derives_the_same_port():
    ports = {SlurmClusterResolver(environ=three_node_task(rank)).master_port for rank in range(7)}
    assert len(ports) == 1


def test_steps_of_jobs_less_than_1000_apart_never_share_a_port():
    ports = [
        read_step(srun_task(SLURM_JOB_ID=str(job), SLURM_STEP_ID=str(step))).port
        for job, step in itertools.product(range(4321, 5321), range(10))
    ]
    assert len(set(ports)) == len(ports) == 10000
    assert min(ports) >= PORT_BASE and max(ports) < PORT_BASE + 10000 <= 32768


def test_a_one_task_step_takes_any_free_port():
    env = srun_task(SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1")
    r = SlurmClusterResolver(environ=env)
    assert (r.world_size, r.local_world_size, r.master_port) == (1, 1, 0)


def test_master_addr_and_port_replace_the_derived_ones():
    env = srun_task(1, MASTER_ADDR="10.1.2.3", MASTER_PORT="29500")
    r = SlurmClusterResolver(environ=env)
    assert (r.master_addr, r.master_port) == ("10.1.2.3", 29500)
    r = SlurmClusterResolver(master_addr="vm-ib", master_port=4000, environ=env)
    assert (r.master_addr, r.master_port) == ("vm-ib", 4000)


def test_rank_0_away_from_the_first_node_needs_master_addr():
    env = three_node_task(0, SLURM_NODEID="2", SLURM_LOCALID="0")  # an arbitrary distribution
    with pytest.raises(ValueError, match=r"^SLURM_PROCID=0 runs on node 2 \(node07\) of the step"):
        SlurmClusterResolver(environ=env)
    assert SlurmClusterResolver(environ={**env, "MASTER_ADDR": "node07"}).master_addr == "node07"


@pytest.mark.parametrize(
    ("gpus", "rank", "gpus_per_task", "shared"),
    [
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_STEP_GPUS": "0,1,2,3"}, 1, 2, True),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 0, 2, True),  # no GPU gres: the user's list
        ({"CUDA_VISIBLE_DEVICES": "1", "SLURM_STEP_GPUS": "0,1"}, 1, 1, False),  # --gpus-per-task
        ({"CUDA_VISIBLE_DEVICES": "0", "SLURM_STEP_GPUS": "4,5"}, 0, 1, False),  # cgroup-renumbered
        ({"CUDA_VISIBLE_DEVICES": "GPU-8a1f,GPU-77c0", "SLURM_STEP_GPUS": "2,3"}, 0, 1, True),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles", "SLURM_STEP_GPUS": "0,1"}, 0, 0, True),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0, 0, True),
    ],
)
def test_gpus_per_task_from_cuda_visible_devices(gpus, rank, gpus_per_task, shared):
    r = SlurmClusterResolver(environ=srun_task(rank, **gpus))
    assert (r.gpus_per_task, r.visible_gpus_shared) == (gpus_per_task, shared)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"SLURM_PROCID": "2"}, r"^SLURM_PROCID=2 is outside 0..SLURM_STEP_NUM_TASKS-1 \(1\)"),
        ({"SLURM_PROCID": "-1"}, r"^SLURM_PROCID='-1' is not a whole number >= 0"),
        ({"SLURM_STEP_NUM_TASKS": "two"}, r"^SLURM_STEP_NUM_TASKS='two' is not a whole number"),
        (
            {"SLURM_STEP_TASKS_PER_NODE": "1"},
            r"^SLURM_STEP_TASKS_PER_NODE='1' places 1 tasks on 1 nodes, but SLURM_STEP_NODELIST "
            r"names 1 nodes and SLURM_STEP_NUM_TASKS=2",
        ),
        (
            {"SLURM_STEP_TASKS_PER_NODE": "1(x2)"},
            r"^SLURM_STEP_TASKS_PER_NODE='1\(x2\)' places 2 tasks on 2 nodes, but "
            r"SLURM_STEP_NODELIST names 1 nodes",
        ),
        ({"SLURM_STEP_TASKS_PER_NODE": "2x1"}, r"^SLURM_STEP_TASKS_PER_NODE='2x1': '2x1' is not"),
        ({"SLURM_STEP_NODELIST": "vm["}, r"^SLURM_STEP_NODELIST='vm\[' has unpaired"),
        ({"SLURM_NODEID": "1"}, r"^SLURM_NODEID=1 but the step has 1 node\(s\)"),
        ({"SLURM_LOCALID": "2"}, r"^SLURM_LOCALID=2 but SLURM_STEP_TASKS_PER_NODE gives node 0"),
        ({"SLURM_JOB_ID": "1_2"}, r"^SLURM_JOB_ID='1_2' is not a whole number"),
        ({"MASTER_PORT": "0"}, r"^MASTER_PORT='0' is outside 1..65535"),
        ({"MASTER_PORT": "x"}, r"^MASTER_PORT='x' is not an integer"),
        ({"MASTER_ADDR": "a b"}, r"^MASTER_ADDR='a b' is not a host name"),
    ],
)
def test_contradictory_or_malformed_variables_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        SlurmClusterResolver(environ=srun_task(**overrides))


@pytest.mark.parametrize(
    "name",
    [
        "SLURM_STEP_NUM_TASKS",
        "SLURM_PROCID",
        "SLURM_STEP_NODELIST",
        "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_NODEID",
        "SLURM_LOCALID",
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
    ],
)
def test_a_missing_variable_says_to_start_the_program_with_srun(name):
    env = {k: v for k, v in srun_task().items() if k != name}
    with pytest.raises(ValueError, match=rf"^{name} is not set: .*`srun python train.py`"):
        SlurmClusterResolver(environ=env)


def test_the_batch_script_is_not_a_step():
    with pytest.raises(ValueError, match=r"^SLURM_STEP_NUM_TASKS is not set: .* batch script"):
        SlurmClusterResolver(environ=SBATCH_SCRIPT)


# --- resolve_cluster -------------------------------------------------------------------------


def test_resolve_picks_slurm_in_an_srun_step():
    r = resolve_cluster(srun_task(1))
    assert isinstance(r, SlurmClusterResolver) and (r.rank, r.world_size) == (1, 2)


@pytest.mark.parametrize("env", [SBATCH_SCRIPT, SALLOC_SHELL], ids=["sbatch", "salloc"])
def test_resolve_runs_one_local_worker_outside_a_step(env):
    assert isinstance(resolve_cluster(env), LocalClusterResolver)


def test_resolve_prefers_a_launcher_started_by_srun():
    """srun starting one torchrun per node: torchrun's workers are the workers."""
    env = srun_task(RANK="5", WORLD_SIZE="8", MASTER_ADDR="vm", MASTER_PORT="29500")
    r = resolve_cluster(env)
    assert isinstance(r, TorchrunClusterResolver) and (r.rank, r.world_size) == (5, 8)


def test_resolve_prefers_tf_config_inside_a_step():
    cluster = {"worker": ["vm:2222", "vm:2223", "vm:2224"]}
    task = {"type": "worker", "index": 2}
    env = srun_task(TF_CONFIG=json.dumps({"cluster": cluster, "task": task}))
    r = resolve_cluster(env)
    assert isinstance(r, TFConfigClusterResolver) and (r.rank, r.world_size) == (2, 3)


def test_resolve_reports_a_malformed_step():
    with pytest.raises(ValueError, match=r"^SLURM_PROCID=7 is outside"):
        resolve_cluster(srun_task(7))


# --- real runs -------------------------------------------------------------------------------


def _job_id_with_a_free_port() -> str:
    """A job id whose step 0 rendezvous port is free on 127.0.0.1 now."""
    for job_id in range(1, 1000):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", read_step(srun_task(SLURM_JOB_ID=str(job_id))).port))
            except OSError:
                continue
        return str(job_id)
    raise AssertionError(f"no free port in {PORT_BASE}..{PORT_BASE + 9999} for step 0")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_tasks_of_a_step_train_as_one_process_does(tmp_path, plain_run):
    """The variables srun sets in the two tasks of a one-node step, node ``localhost``."""
    job_id = _job_id_with_a_free_port()
    node = {"SLURM_STEP_NODELIST": "localhost", "SLURMD_NODENAME": "localhost"}
    workers = [
        start_process(
            [*COMMAND, str(tmp_path)],
            {**plain_env(), **srun_task(rank, SLURM_JOB_ID=job_id, **node)},
            rank,
        )
        for rank in range(2)
    ]
    assert_all_succeeded(wait_workers(workers, 120))
    assert_trained_as_one_process(tmp_path, plain_run, "SlurmClusterResolver")


def _slurm_answers() -> bool:
    """Whether srun can start a step here: a controller answers ``scontrol ping``."""
    if shutil.which("srun") is None or shutil.which("scontrol") is None:
        return False
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return ping.returncode == 0 and "UP" in ping.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not _slurm_answers(), reason="no SLURM controller answers (srun, scontrol ping); CI has none"
)
def test_srun_runs_the_program_as_two_workers(tmp_path, plain_run):
    srun = ["srun", "--nodes=1", "--ntasks=2", "--time=4", "--kill-on-bad-exit=1"]
    run = subprocess.run(
        [*srun, *COMMAND, str(tmp_path)],
        cwd=REPO,
        env=plain_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert_trained_as_one_process(tmp_path, plain_run, "SlurmClusterResolver")
