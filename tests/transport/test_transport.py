"""Transfer groups join processes of separate jobs without touching their default worlds."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_world
from _jobs import free_port, job_world, parent_store

from awex_fast.transport import TransferError, init_transfer_group


def _two_jobs_one_group(rank, world_size, port, group_port):
    # jobs: ranks 0-1 ("inference") and 2-3 ("training"), each with its own default world
    job, _, _ = job_world(port, rank, [2, 2])
    group = init_transfer_group("gloo", rank, world_size, "127.0.0.1", group_port, timeout=60)
    payload = torch.full((1000,), float(rank))
    peer = (rank + 2) % 4  # across the jobs
    if rank >= 2:
        group.isend(payload, peer, 7).wait(30)
        got = None
    else:
        buf = torch.empty(1000)
        group.irecv(buf, peer, 7).wait(30)
        got = buf[0].item()
    # the job's own default world still works and only spans the job
    x = torch.tensor([1.0])
    dist.all_reduce(x)
    group.close()
    return {"job": job, "got": got, "job_sum": x.item(), "job_size": dist.get_world_size()}


def test_transfer_group_spans_jobs_and_leaves_default_worlds_alone():
    store = parent_store()
    out = run_world(_two_jobs_one_group, 4, store.port, free_port(), backend=None, timeout=120)
    assert [o["got"] for o in out] == [2.0, 3.0, None, None]
    assert all(o["job_sum"] == 2.0 and o["job_size"] == 2 for o in out)


def _timeout_worker(rank, world_size, group_port, backend):
    group = init_transfer_group(backend, rank, world_size, "127.0.0.1", group_port, timeout=30)
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            group.irecv(torch.empty(4), 1, 0).wait(1.0)  # rank 1 never sends
        elapsed = time.monotonic() - t0
        connect_ok = True
    else:
        time.sleep(2.0)
        elapsed, connect_ok = 0.0, True
    group.abort()
    return {"elapsed": elapsed, "ok": connect_ok}


@pytest.mark.parametrize(("transfer_backend", "bound_s"), [("gloo", 10), ("ipc", 5)])
def test_wait_times_out_instead_of_hanging(transfer_backend, bound_s):
    out = run_world(_timeout_worker, 2, free_port(), transfer_backend, backend=None, timeout=90)
    assert 0.9 <= out[0]["elapsed"] < bound_s


def _dead_peer_worker(rank, world_size, group_port):
    group = init_transfer_group("gloo", rank, world_size, "127.0.0.1", group_port, timeout=30)
    if rank == 1:
        return {"error": None}  # the process exits without sending: its sockets close
    t0 = time.monotonic()
    try:
        group.irecv(torch.empty(4), 1, 0).wait(20.0)
    except (RuntimeError, TimeoutError) as exc:
        return {"error": type(exc).__name__, "elapsed": time.monotonic() - t0}
    return {"error": None}


def test_peer_that_leaves_makes_the_wait_fail():
    out = run_world(_dead_peer_worker, 2, free_port(), backend=None, timeout=90)
    assert out[0]["error"] is not None and out[0]["elapsed"] <= 21


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown transfer backend 'mpi'"):
        init_transfer_group("mpi", 0, 1, "127.0.0.1", 1)
    with pytest.raises(ValueError, match="rank 3 outside a world of 2"):
        init_transfer_group("gloo", 3, 2, "127.0.0.1", 1)
    assert issubclass(TransferError, RuntimeError)
    assert "peer=3" in str(TransferError("boom", peer=3, bucket=1, version=2))
