"""The membership protocol of ``mirrored.parameter_server.rpc_cluster`` on a real store, without
RPC: who a restarted task joins as, and the chief's answers (the whole path runs in the multiprocess
tests)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from mirrored.parameter_server.rpc_cluster import Member, RpcCluster, _incarnation

CLUSTER = RpcCluster.of(num_workers=2, num_ps=1)  # chief 0, worker0 1, worker1 2, ps0 3


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )


def _client(store: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", store.port, None, False, timeout=datetime.timedelta(seconds=10)
    )


def _answer(store: dist.TCPStore, refusal: str, requests: list[list[str]]) -> threading.Thread:
    """The chief's side, by hand: read the first request into ``requests`` and answer it."""

    def answer() -> None:
        client = _client(store)
        client.wait(["mirrored/rpc_cluster/request/1"])
        request = client.get("mirrored/rpc_cluster/request/1").decode().split()
        requests.append(request)
        client.set(f"mirrored/rpc_cluster/admitted/{request[1]}", refusal)

    thread = threading.Thread(target=answer)
    thread.start()
    return thread


def _joined(store: dist.TCPStore, task: str) -> None:
    """``task``'s first process counts itself and joins the group (as ``start_rpc`` records)."""
    member = _incarnation(_client(store), task, CLUSTER, 5)
    _client(store).set(f"mirrored/rpc_cluster/joined/{task}", member.name)


def test_a_first_start_joins_under_the_task_s_own_name_and_rank(store: dist.TCPStore) -> None:
    assert _incarnation(_client(store), "worker1", CLUSTER, 5) == Member("worker1", "worker1", 2)
    assert _incarnation(_client(store), "ps0", CLUSTER, 5) == Member("ps0", "ps0", 3)


def test_restarted_workers_join_as_new_incarnations_with_ranks_of_their_own(
    store: dist.TCPStore,
) -> None:
    _joined(store, "worker1")
    requests: list[list[str]] = []
    answering = _answer(store, "", requests)
    assert _incarnation(_client(store), "worker1", CLUSTER, 5) == Member("worker1", "worker1_2", 4)
    answering.join()
    assert requests == [["worker1", "worker1_2", "4"]]


def test_a_refused_worker_exits_with_the_chief_s_reason(store: dist.TCPStore) -> None:
    _joined(store, "worker0")
    answering = _answer(store, "the job has ended", [])
    with pytest.raises(SystemExit, match="worker0 was restarted but cannot rejoin: the job has"):
        _joined(store, "worker0")
    answering.join()


def test_an_unanswered_worker_gives_up_after_the_timeout(store: dist.TCPStore) -> None:
    _joined(store, "worker0")
    with pytest.raises(SystemExit, match=r"did not admit it within 0\.5 s"):
        _incarnation(_client(store), "worker0", CLUSTER, 0.5)


def test_a_restarted_ps_task_is_told_to_restart_the_job(store: dist.TCPStore) -> None:
    _joined(store, "ps0")
    with pytest.raises(SystemExit, match=r"restart the whole job \(every task\); it resumes from"):
        _joined(store, "ps0")


@pytest.mark.parametrize("task", ["worker1", "ps0"])
def test_a_restart_of_a_task_lost_before_it_joined_joins_as_the_task(
    store: dist.TCPStore, task: str
) -> None:
    """The chief still waits for the task itself: its restart takes its name and rank."""
    first = _incarnation(_client(store), task, CLUSTER, 5)  # then lost before it joined
    assert _incarnation(_client(store), task, CLUSTER, 5) == first


def test_a_restarted_worker_is_told_once_the_chief_takes_no_more(store: dist.TCPStore) -> None:
    _joined(store, "worker0")
    _client(store).set("mirrored/rpc_cluster/closed", "")  # Admissions.stop()
    with pytest.raises(SystemExit, match="worker0 was restarted but cannot rejoin: the job has"):
        _incarnation(_client(store), "worker0", CLUSTER, 5)
