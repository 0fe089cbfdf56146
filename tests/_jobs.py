"""Separate "jobs" inside one spawned world, for weight-sync tests.

A real deployment has a training job and inference engines, each with its own default process
group, that only meet in the transfer group. Tests spawn one world of processes with
``run_world(..., backend=None)`` and let each process join its own job's default gloo world
through a parent-hosted store (`job_world`), so the transfer group is proven not to need or
touch any of them.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch.distributed as dist

from awex_fast.net import free_port  # noqa: F401  (the tests take it from here)


def parent_store(timeout: float = 120.0) -> dist.TCPStore:
    """A TCPStore on a free port, kept by the test process for the workers' rendezvous."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
    )


def connect(port: int, timeout: float = 120.0) -> dist.TCPStore:
    """A worker's client of the parent store."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def job_of(rank: int, job_sizes: Sequence[int]) -> tuple[int, int, int]:
    """(job index, rank inside the job, job size) of a spawned-world rank; jobs are laid out in order."""
    start = 0
    for j, n in enumerate(job_sizes):
        if rank < start + n:
            return j, rank - start, n
        start += n
    raise ValueError(f"rank {rank} beyond jobs {list(job_sizes)}")


def job_world(port: int, rank: int, job_sizes: Sequence[int], timeout: float = 120.0) -> tuple[int, int, int]:
    """Initialise this process's default gloo world as its job's world; returns job_of(rank)."""
    job, local, size = job_of(rank, job_sizes)
    store = dist.PrefixStore(f"job{job}/", connect(port, timeout))
    dist.init_process_group(
        "gloo", store=store, rank=local, world_size=size, timeout=datetime.timedelta(seconds=timeout)
    )
    return job, local, size
