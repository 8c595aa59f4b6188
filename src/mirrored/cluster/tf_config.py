"""``TF_CONFIG``, TensorFlow's description of a cluster, parsed and checked.

``TF_CONFIG`` is one JSON document per task: ``cluster`` (job name -> the tasks' "host:port"
addresses) and ``task`` (this process's job and index). Every rule TensorFlow applies is checked
here, with an error that names the field, what it holds and the fix, so that a mistyped cluster
fails before any socket opens. The host helpers serve the torchrun resolver too.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "JOBS",
    "NON_WORKER_JOBS",
    "WORKER_JOBS",
    "TFConfig",
    "is_host_name",
    "is_int",
    "is_ipv6",
    "normalize_host",
    "parse_tf_config",
]

#: Synchronous workers, in rank order.
WORKER_JOBS = ("chief", "worker")
#: Tasks that take no part in the synchronous all-reduce (rank -1).
NON_WORKER_JOBS = ("ps", "evaluator")
JOBS = WORKER_JOBS + NON_WORKER_JOBS

_HOSTNAME = re.compile(r"[A-Za-z0-9_.-]+")
_PORT = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class TFConfig:
    """A checked ``TF_CONFIG``: the cluster, this task, and every task's (host, port)."""

    cluster: dict[str, list[str]]
    task_type: str
    task_id: int
    addresses: dict[tuple[str, int], tuple[str, int]]  # (job, index) -> (host, port)


def parse_tf_config(tf_config: str | Mapping[str, Any], source: str) -> TFConfig:
    """``tf_config`` (the JSON text, or the parsed dict) checked; ``source`` names it in errors
    (``TF_CONFIG`` or ``tf_config``)."""
    cluster, task_type, task_id = _validate(_parse_json(tf_config, source), source)
    return TFConfig(cluster, task_type, task_id, _parse_cluster(cluster, source))


def is_host_name(host: str) -> bool:
    """Letters, digits, ``_``, ``.`` and ``-`` only: a host name or an IPv4 address."""
    return bool(_HOSTNAME.fullmatch(host))


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def normalize_host(host: str) -> str:
    """One spelling per host, so '[::1]' and '[0:0::1]' compare equal."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.lower()


def _parse_json(tf_config: str | Mapping[str, Any], source: str) -> Mapping[str, Any]:
    if isinstance(tf_config, str):
        try:
            parsed = json.loads(tf_config)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{source} is not valid JSON ({err}); expected e.g. "
                '{"cluster": {"worker": ["host0:2222"]}, "task": {"type": "worker", "index": 0}}'
            ) from None
    elif isinstance(tf_config, Mapping):
        parsed = tf_config
    else:
        raise TypeError(
            f"tf_config={tf_config!r}: expected the TF_CONFIG JSON text, a dict, or None "
            "(read the TF_CONFIG environment variable)"
        )
    if not isinstance(parsed, Mapping):
        raise ValueError(
            f"{source} must be a JSON object with 'cluster' and 'task'; got "
            f"{type(parsed).__name__} {parsed!r}"
        )
    return parsed


def _validate(config: Mapping[str, Any], source: str) -> tuple[dict[str, list[str]], str, int]:
    """Check the shape of a parsed TF_CONFIG; return (cluster, task type, task index)."""
    if "cluster" not in config:
        raise ValueError(
            f"{source} has no 'cluster'; add the jobs' addresses, e.g. "
            '"cluster": {"worker": ["host0:2222", "host1:2222"]}'
        )
    if "task" not in config:
        raise ValueError(
            f"{source} has no 'task'; add this process's task, e.g. "
            '"task": {"type": "worker", "index": 0}'
        )
    cluster, task = config["cluster"], config["task"]
    if not isinstance(cluster, Mapping):
        raise ValueError(
            f"{source}['cluster']={cluster!r}: expected an object of job name -> address list"
        )
    if not isinstance(task, Mapping):
        raise ValueError(
            f"{source}['task']={task!r}: expected an object like {{'type': 'worker', 'index': 0}}"
        )
    _check_jobs(cluster, source)
    task_type, task_id = _check_task(task, cluster, source)
    return {job: list(cluster[job]) for job in JOBS if job in cluster}, task_type, task_id


def _check_jobs(cluster: Mapping[str, Any], source: str) -> None:
    """Known jobs, each a list of addresses: a chief job of one task, one evaluator at most,
    and at least one synchronous worker."""
    unknown = sorted(str(job) for job in cluster if job not in JOBS)
    if unknown:
        raise ValueError(
            f"{source}['cluster'] has unknown jobs {unknown}; the jobs are {', '.join(JOBS)} "
            "(rename or remove the others)"
        )
    for job, tasks in cluster.items():
        if not isinstance(tasks, list) or not all(isinstance(a, str) for a in tasks):
            raise ValueError(
                f"{source}['cluster'][{job!r}]={tasks!r}: expected a list of 'host:port' strings"
            )
    if "chief" in cluster and len(cluster["chief"]) != 1:
        raise ValueError(
            f"{source}['cluster']['chief'] has {len(cluster['chief'])} tasks; a 'chief' job must "
            "have exactly one (list the other tasks under 'worker')"
        )
    if len(cluster.get("evaluator", [])) > 1:
        raise ValueError(
            f"{source}['cluster']['evaluator'] has {len(cluster['evaluator'])} tasks; "
            "TensorFlow allows at most one evaluator"
        )
    if not cluster.get("chief") and not cluster.get("worker"):
        raise ValueError(
            f"{source}['cluster'] has no 'chief' and no 'worker' task; list at least one "
            'synchronous worker, e.g. "worker": ["host0:2222"]'
        )


def _check_task(
    task: Mapping[str, Any], cluster: Mapping[str, Any], source: str
) -> tuple[str, int]:
    """This process's task: a job of the cluster (or the evaluator) and an index in it."""
    if "type" not in task or "index" not in task:
        missing = "type" if "type" not in task else "index"
        raise ValueError(
            f'{source}[\'task\'] has no {missing!r}; expected e.g. {{"type": "worker", "index": 0}}'
        )
    task_type, task_id = task["type"], task["index"]
    if task_type not in JOBS:
        raise ValueError(
            f"{source}['task']['type']={task_type!r}: expected one of {', '.join(JOBS)}"
        )
    if not is_int(task_id):
        raise ValueError(f"{source}['task']['index']={task_id!r}: expected an int >= 0")
    if task_type not in cluster and task_type != "evaluator":
        raise ValueError(
            f"{source}['task']['type']={task_type!r} is not a job of the cluster (jobs: "
            f"{', '.join(cluster)}); add its addresses to cluster[{task_type!r}] or fix the type"
        )
    if task_type in cluster and not 0 <= task_id < len(cluster[task_type]):
        size = len(cluster[task_type])
        plural = "s" if size > 1 else ""
        tasks = f"{size} task{plural} (indices 0..{size - 1})" if size else "no tasks"
        raise ValueError(
            f"{source}['task']['index']={task_id} is out of range: job {task_type!r} has "
            f"{tasks}; fix the index or add the task's address to cluster[{task_type!r}]"
        )
    if task_id < 0:
        raise ValueError(f"{source}['task']['index']={task_id}: expected an int >= 0")
    return task_type, task_id


def _parse_address(address: str, where: str) -> tuple[str, int]:
    """'host:port' or '[ipv6]:port' -> (host without brackets, port in 1..65535)."""
    example = "e.g. 'host0:2222', '10.0.0.1:2222' or '[::1]:2222'"
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep or not is_ipv6(host):
            raise ValueError(
                f"{where}={address!r} is not '[ipv6]:port'; write IPv6 addresses as '[::1]:2222'"
            )
    else:
        host, sep, port = address.rpartition(":")
        if is_ipv6(host):
            raise ValueError(
                f"{where}={address!r}: an IPv6 address must be in brackets, e.g. '[::1]:2222'"
            )
        if not sep or not _HOSTNAME.fullmatch(host):
            raise ValueError(f"{where}={address!r} is not 'host:port'; {example}")
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise ValueError(f"{where}={address!r}: the port must be a number in 1..65535; {example}")
    return host, int(port)


def _parse_cluster(
    cluster: Mapping[str, list[str]], source: str
) -> dict[tuple[str, int], tuple[str, int]]:
    """(job, index) -> (host, port) for every task; no address may be used twice."""
    addresses: dict[tuple[str, int], tuple[str, int]] = {}
    seen: dict[tuple[str, int], str] = {}
    for job, tasks in cluster.items():
        for index, address in enumerate(tasks):
            host, port = _parse_address(address, f"{source}['cluster'][{job!r}][{index}]")
            key = (normalize_host(host), port)
            name = f"{job} {index} ({address!r})"
            if key in seen:
                raise ValueError(
                    f"{source}['cluster']: {seen[key]} and {name} use the same address; "
                    "give every task its own host:port"
                )
            seen[key] = name
            addresses[(job, index)] = (host, port)
    return addresses
