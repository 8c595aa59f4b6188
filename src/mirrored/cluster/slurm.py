"""SLURM's rules: its compressed host lists and task counts, and one task of an ``srun`` step.

``srun`` tells each task of a step where it stands (srun(1), OUTPUT ENVIRONMENT VARIABLES): its
rank ``SLURM_PROCID`` among ``SLURM_STEP_NUM_TASKS`` tasks, the step's nodes
``SLURM_STEP_NODELIST`` in SLURM's compressed form (``node[01-04,07]``), the tasks on each
``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``), its node's position in that list ``SLURM_NODEID``
and its index among that node's tasks ``SLURM_LOCALID``. Only a step's variables are read: the
batch script of ``sbatch`` has ``SLURM_PROCID=0`` and ``SLURM_NTASKS=N`` too, but it is one
process, and N workers expected there would wait for tasks that never start (SLURM 22.05 sets no
``SLURM_STEP_*`` variable in the batch script, nor ``SLURM_PROCID`` in an ``salloc`` shell).

:class:`mirrored.cluster.resolvers.SlurmClusterResolver` makes a :class:`SlurmStep` a cluster
resolver; nothing here opens a socket, so every rule is tested with variables alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "MAX_HOSTS",
    "PORT_BASE",
    "SlurmStep",
    "expand_hostlist",
    "expand_tasks_per_node",
    "in_slurm_step",
    "read_step",
]

#: SLURM's own bound on one host range (``MAX_RANGE`` in its hostlist.c); more is a typo.
MAX_HOSTS = 65536
#: The rendezvous ports of steps lie in PORT_BASE..PORT_BASE+9999, below Linux's ephemeral ports
#: (32768 and up) so that no outgoing connection holds one.
PORT_BASE = 20000

# A host list entry: names and bracketed ranges, no comma outside the brackets.
_ENTRY = r"(?:[^\[\],\s]+|\[[^\[\]\s]*\])+"
_HOSTLIST = re.compile(rf"{_ENTRY}(?:,{_ENTRY})*")
_PIECE = re.compile(r"\[([^\[\]]*)\]|([^\[\]]+)")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_COUNT = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_NOT_IN_STEP = (
    "this process is not a task of an srun step (the batch script of sbatch and an salloc "
    "shell are not: run the program with `srun python train.py`)"
)


@dataclass(frozen=True)
class SlurmStep:
    """One task of an ``srun`` step, its variables read and checked together (:func:`read_step`).

    ``visible_gpus`` counts ``CUDA_VISIBLE_DEVICES``; ``gpus_bound`` says SLURM gave them to
    this task alone (``--gpus-per-task``, ``--gpu-bind``), which shows as fewer than the step's
    GPUs on the node (``SLURM_STEP_GPUS``); otherwise the node's tasks share them.
    """

    rank: int
    num_tasks: int
    local_rank: int
    hosts: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    node_index: int
    job_id: int
    step_id: int
    visible_gpus: int
    gpus_bound: bool

    @property
    def local_world_size(self) -> int:
        """The tasks of this step on this task's node."""
        return self.tasks_per_node[self.node_index]

    @property
    def port(self) -> int:
        """The rendezvous port, alike in every task of the step: the job id's last three digits
        and the step id's last digit above ``PORT_BASE``, so that two jobs whose ids differ by
        less than 1000, or two steps of one job, never meet on one node's port."""
        return PORT_BASE + (self.job_id % 1000) * 10 + self.step_id % 10

    @property
    def gpus_per_task(self) -> int:
        """This task's GPUs: all it sees when SLURM bound them to it, else an equal share of
        its node's (TensorFlow's ``gpus_per_node // tasks_per_node``)."""
        return self.visible_gpus if self.gpus_bound else self.visible_gpus // self.local_world_size


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """Whether ``srun`` started this process as a task of a step (``SLURM_STEP_NUM_TASKS``)."""
    return "SLURM_STEP_NUM_TASKS" in environ


def read_step(environ: Mapping[str, str]) -> SlurmStep:
    """This task of the step, from the variables ``srun`` sets; a missing or contradictory one
    is a ``ValueError`` naming it."""
    num_tasks = _int(environ, "SLURM_STEP_NUM_TASKS")
    rank = _int(environ, "SLURM_PROCID")
    if not 0 <= rank < num_tasks:
        raise ValueError(
            f"SLURM_PROCID={rank} is outside 0..SLURM_STEP_NUM_TASKS-1 ({num_tasks - 1}); "
            "srun numbers a step's tasks from 0: unset any SLURM_* variable set by hand"
        )
    hosts = expand_hostlist(_text(environ, "SLURM_STEP_NODELIST"), "SLURM_STEP_NODELIST")
    counts = expand_tasks_per_node(
        _text(environ, "SLURM_STEP_TASKS_PER_NODE"), "SLURM_STEP_TASKS_PER_NODE"
    )
    if len(counts) != len(hosts) or sum(counts) != num_tasks:
        raise ValueError(
            f"SLURM_STEP_TASKS_PER_NODE={environ['SLURM_STEP_TASKS_PER_NODE']!r} places "
            f"{sum(counts)} tasks on {len(counts)} nodes, but SLURM_STEP_NODELIST names "
            f"{len(hosts)} nodes and SLURM_STEP_NUM_TASKS={num_tasks}; they describe one step "
            "only as srun sets them (a heterogeneous step is not supported)"
        )
    node_index = _int(environ, "SLURM_NODEID")
    if node_index >= len(hosts):
        raise ValueError(
            f"SLURM_NODEID={node_index} but the step has {len(hosts)} node(s) "
            f"(SLURM_STEP_NODELIST={environ['SLURM_STEP_NODELIST']!r}); it is this node's "
            "position in that list, from 0"
        )
    local_rank = _int(environ, "SLURM_LOCALID")
    if local_rank >= counts[node_index]:
        raise ValueError(
            f"SLURM_LOCALID={local_rank} but SLURM_STEP_TASKS_PER_NODE gives node "
            f"{node_index} ({hosts[node_index]}) {counts[node_index]} task(s); it is the "
            "task's index on its node, from 0"
        )
    visible = _gpu_count(environ.get("CUDA_VISIBLE_DEVICES"))
    return SlurmStep(
        rank=rank,
        num_tasks=num_tasks,
        local_rank=local_rank,
        hosts=tuple(hosts),
        tasks_per_node=tuple(counts),
        node_index=node_index,
        job_id=_int(environ, "SLURM_JOB_ID"),
        step_id=_int(environ, "SLURM_STEP_ID"),
        visible_gpus=visible,
        gpus_bound=0 < visible < _gpu_count(environ.get("SLURM_STEP_GPUS")),
    )


def expand_hostlist(hostlist: str, variable: str = "hostlist") -> list[str]:
    """The host names of a SLURM host list, in order and duplicates kept, as ``scontrol show
    hostnames`` prints them; ``variable`` names the list in errors.

    ``node[01-04,07],login1`` is node01..node04, node07, login1: a range's numbers keep the
    width of its first bound (``n[098-101]``: n098, n099, n100, n101). Several bracket groups
    in one name combine, the first varying slowest (``r[1-2]n[1-2]``: r1n1, r1n2, r2n1, r2n2),
    and text after a group stays (``n[1-3]-ib``; SLURM 22.05 itself refuses that form, other
    host-list tools write it).
    """
    text = hostlist.strip()
    problem = _hostlist_problem(text)
    if problem:
        raise _not_a_hostlist(variable, hostlist, problem)
    hosts: list[str] = []
    for entry in re.finditer(_ENTRY, text):
        names = [""]
        for ranges, literal in _PIECE.findall(entry.group()):
            bounds = [] if literal else _bounds(ranges, variable, hostlist)
            count = sum(high - low + 1 for low, high, _ in bounds) if bounds else 1
            if len(hosts) + len(names) * count > MAX_HOSTS:  # before any list grows that long
                raise _not_a_hostlist(variable, hostlist, f"names more than {MAX_HOSTS} hosts")
            parts = [literal] if literal else _numbers(bounds)
            names = [name + part for name in names for part in parts]
        hosts += names
    return hosts


def expand_tasks_per_node(tasks_per_node: str, variable: str = "tasks_per_node") -> list[int]:
    """SLURM's task count per node, one per node: ``2(x3),1`` is [2, 2, 2, 1] (``(xN)``
    repeats a count for N nodes); ``variable`` names the list in errors."""
    counts: list[int] = []
    for part in tasks_per_node.strip().split(","):
        match = _COUNT.fullmatch(part)
        repeat = int(match[2] or 1) if match else 0
        if match is None or int(match[1]) < 1 or not 1 <= repeat <= MAX_HOSTS:
            raise ValueError(
                f"{variable}={tasks_per_node!r}: {part!r} is not a task count; expected counts "
                "of at least 1 separated by commas, '(xN)' repeating one for N nodes, e.g. "
                "'2(x3),1' (2 tasks on each of 3 nodes, then 1)"
            )
        counts += [int(match[1])] * repeat
    return counts


def _hostlist_problem(text: str) -> str | None:
    """What makes ``text`` (stripped) no host list, beyond its ranges; None if nothing."""
    if not text:
        return "is empty"
    if re.search(r"\s", text):
        return "contains whitespace"
    depth = 0
    for char in text:
        depth += (char == "[") - (char == "]")
        if depth not in (0, 1):
            break
    if depth:
        return "has unpaired or nested brackets"
    if not _HOSTLIST.fullmatch(text):
        return "has an empty entry (a comma at an end, or two in a row)"
    return None


def _bounds(ranges: str, variable: str, hostlist: str) -> list[tuple[int, int, int]]:
    """``01-03,7`` -> (1, 3, 2), (7, 7, 1): each range's bounds and its first bound's width."""
    bounds = []
    for part in ranges.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise _not_a_hostlist(
                variable, hostlist, f"has [{ranges}], which is not numbers and ranges (a-b)"
            )
        low, high = int(match[1]), int(match[2] or match[1])
        if high < low:
            raise _not_a_hostlist(variable, hostlist, f"has the backward range {part!r}")
        bounds.append((low, high, len(match[1])))
    return bounds


def _numbers(bounds: list[tuple[int, int, int]]) -> list[str]:
    """The numbers of ``_bounds``' ranges, zero-padded to each range's width."""
    return [str(n).zfill(width) for low, high, width in bounds for n in range(low, high + 1)]


def _not_a_hostlist(variable: str, hostlist: str, problem: str) -> ValueError:
    return ValueError(
        f"{variable}={hostlist!r} {problem}; a SLURM host list is names and bracketed numeric "
        "ranges separated by commas, e.g. 'node[01-04,07],login1' (as srun sets it)"
    )


def _text(environ: Mapping[str, str], name: str) -> str:
    if name not in environ:
        raise ValueError(f"{name} is not set: {_NOT_IN_STEP}")
    return environ[name]


def _int(environ: Mapping[str, str], name: str) -> int:
    """A count or id that srun sets (a whole number >= 0)."""
    value = _text(environ, name).strip()
    if not value.isascii() or not value.isdigit():
        raise ValueError(
            f"{name}={environ[name]!r} is not a whole number >= 0; srun sets it so: unset any "
            "SLURM_* variable set by hand"
        )
    return int(value)


def _gpu_count(devices: str | None) -> int:
    """The GPUs a list such as ``CUDA_VISIBLE_DEVICES`` names (indices or UUIDs); none when
    unset, empty, or SLURM's ``NoDevFiles``."""
    if devices is None or devices.strip() in ("", "NoDevFiles"):
        return 0
    return len([device for device in devices.split(",") if device.strip()])
