"""examples/kubernetes/: the TFJob and PyTorchJob manifests, with the environment Kubeflow's
training operator gives each of their pods.

``operator_env`` writes what the operator (v1, release 1.9) sets: for a TFJob,
``genTFConfigJSONStr`` in pkg/controller.v1/tensorflow/tensorflow.go (the format its
pod_test.go expects); for a PyTorchJob, ``setPodEnv`` in pkg/controller.v1/pytorch/envvar.go and
the master variables of master.go, with the API's defaults (ports 2222 and 23456,
``nprocPerNode`` "auto"). Each pod's environment must resolve to its rank, and two processes
given those environments (the services on 127.0.0.1) must train as one device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from mirrored.examples import distributed_loop

from mirrored.cluster.resolvers import (
    ClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    resolve_cluster,
)
from tests.exactness import assert_close_float64
from tests.multiprocess.spawn import (
    REPO,
    assert_all_succeeded,
    cluster_ports,
    free_port,
    program_env,
    start_process,
    wait_workers,
)
from tests.reference_loops import OPTIMIZERS, make_batches, make_mlp, train_plain

MANIFESTS = REPO / "examples" / "kubernetes"
NAMESPACE = "default"  # the manifests name none: kubectl's namespace, "default" unless set
# What the operator reads from a replica's pod: the container and port names (kubeflow.org/v1).
CONTAINER = {"TFJob": "tensorflow", "PyTorchJob": "pytorch"}
PORT = {"TFJob": ("tfjob-port", 2222), "PyTorchJob": ("pytorchjob-port", 23456)}
REPLICAS = {"TFJob": "tfReplicaSpecs", "PyTorchJob": "pytorchReplicaSpecs"}

Pods = list[dict[str, str]]


def _manifest(name: str) -> dict[str, Any]:
    return yaml.safe_load((MANIFESTS / name).read_text())


def _container(kind: str, replica: dict[str, Any]) -> dict[str, Any]:
    (container,) = [
        c for c in replica["template"]["spec"]["containers"] if c["name"] == CONTAINER[kind]
    ]
    return container


def _port(kind: str, replica: dict[str, Any]) -> int:
    name, default = PORT[kind]
    ports = _container(kind, replica).get("ports", [])
    return next((p["containerPort"] for p in ports if p.get("name") == name), default)


def operator_env(manifest: dict[str, Any]) -> Pods:
    """The operator's variables in the pod of each synchronous worker, rank 0 first (a TFJob's
    chief, else worker 0; a PyTorchJob's master)."""
    kind, job = manifest["kind"], manifest["metadata"]["name"]
    replicas = manifest["spec"][REPLICAS[kind]]
    counts = {rtype: spec.get("replicas", 1) for rtype, spec in replicas.items()}
    if kind == "TFJob":
        cluster = {
            rtype.lower(): [
                f"{job}-{rtype.lower()}-{i}.{NAMESPACE}.svc:{_port(kind, spec)}"
                for i in range(counts[rtype])
            ]
            for rtype, spec in sorted(replicas.items(), key=lambda item: item[0].lower())
        }
        tasks = [(t, i) for t in ("chief", "worker") for i in range(len(cluster.get(t, [])))]
        return [
            {
                "TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": t, "index": i}, "environment": "cloud"},
                    separators=(",", ":"),
                )
            }
            for t, i in tasks
        ]
    port = str(_port(kind, replicas["Master"]))
    world_size = str(sum(counts.values()))
    return [
        {
            "PYTHONUNBUFFERED": "1",
            "MASTER_PORT": port,
            "PET_MASTER_PORT": port,
            "MASTER_ADDR": f"{job}-master-0",
            "PET_MASTER_ADDR": f"{job}-master-0",
            "WORLD_SIZE": world_size,
            "RANK": str(rank),
            "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": "auto",
            "PET_NNODES": world_size,
        }
        for rank in range(int(world_size))
    ]


def on_this_machine(pods: Pods) -> Pods:
    """The same environments with every service at 127.0.0.1 on a free port of its own."""
    if "TF_CONFIG" in pods[0]:
        configs = [json.loads(pod["TF_CONFIG"]) for pod in pods]
        addresses = [a for tasks in configs[0]["cluster"].values() for a in tasks]
        ports = cluster_ports(free_port(), len(addresses))
        local = {a: f"127.0.0.1:{p}" for a, p in zip(addresses, ports, strict=True)}
        for config in configs:
            config["cluster"] = {j: [local[a] for a in t] for j, t in config["cluster"].items()}
        return [{**pod, "TF_CONFIG": json.dumps(c)} for pod, c in zip(pods, configs, strict=True)]
    port = str(free_port())
    local = {"MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1"}
    return [{**pod, **local, "MASTER_PORT": port, "PET_MASTER_PORT": port} for pod in pods]


EXPECTED = {
    "tfjob.yaml": [
        {
            "TF_CONFIG": '{"cluster":{"worker":["mirrored-tfjob-worker-0.default.svc:2222",'
            '"mirrored-tfjob-worker-1.default.svc:2222"]},'
            f'"task":{{"type":"worker","index":{i}}},"environment":"cloud"}}'
        }
        for i in range(2)
    ],
    "pytorchjob.yaml": [
        {
            "PYTHONUNBUFFERED": "1",
            "MASTER_PORT": "23456",
            "PET_MASTER_PORT": "23456",
            "MASTER_ADDR": "mirrored-pytorchjob-master-0",
            "PET_MASTER_ADDR": "mirrored-pytorchjob-master-0",
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": "auto",
            "PET_NNODES": "2",
        }
        for rank in range(2)
    ],
}
RESOLVERS: dict[str, tuple[type[ClusterResolver], str]] = {
    "tfjob.yaml": (TFConfigClusterResolver, "mirrored-tfjob-worker-0.default.svc:2222"),
    "pytorchjob.yaml": (TorchrunClusterResolver, "mirrored-pytorchjob-master-0:23456"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_pod_resolves_to_its_rank(name: str) -> None:
    pods = operator_env(_manifest(name))
    assert pods == EXPECTED[name]
    resolver_type, rendezvous = RESOLVERS[name]
    for rank, env in enumerate(pods):
        resolver = resolve_cluster(env)
        assert type(resolver) is resolver_type
        assert (resolver.rank, resolver.world_size) == (rank, 2)
        assert f"{resolver.master_addr}:{resolver.master_port}" == rendezvous
        # One process per pod: each is alone on its machine (its own host or pod).
        assert (resolver.local_rank, resolver.local_world_size) == (0, 1)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_pod_runs_distributed_loop(name: str) -> None:
    manifest = _manifest(name)
    kind = manifest["kind"]
    assert manifest["apiVersion"] == "kubeflow.org/v1"
    for replica in manifest["spec"][REPLICAS[kind]].values():
        container = _container(kind, replica)
        assert container["command"] == ["python", "-m", "mirrored.examples.distributed_loop"]
        arguments = distributed_loop.parse_args(container["args"])
        assert arguments.checkpoint is None  # a pod's disk goes with it


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_pods_train_as_one_device(tmp_path: Path, name: str) -> None:
    pods = on_this_machine(operator_env(_manifest(name)))
    command = [sys.executable, "-m", "tests.multiprocess.jobs", "custom_loop", str(tmp_path), "sgd"]
    workers = [
        start_process(command, {**program_env(), **env}, rank) for rank, env in enumerate(pods)
    ]
    assert_all_succeeded(wait_workers(workers, timeout=180))
    model = make_mlp()
    losses = train_plain(model, OPTIMIZERS["sgd"](model), make_batches())
    for rank in range(len(pods)):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert_close_float64(result["losses"], losses, msg=f"rank {rank}'s losses")
        (replica,) = result["replicas"]
        for key, value in model.state_dict().items():
            assert_close_float64(replica[key], value, msg=f"rank {rank}: {key}")
