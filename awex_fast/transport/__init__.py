"""Transfer backends: gloo and nccl through torch.distributed, native NCCL (dlopen), and ipc
(POSIX shared memory between the processes of one host, its segments in `transport.shm`).

Every group declares its ``strategy`` (`STAGED`, or `SHARED_SLOTS` for a `SharedSlotGroup`): how
an executor moves messages over it."""

from __future__ import annotations

from collections.abc import Callable

from awex_fast.transport.base import (
    SHARED_SLOTS,
    STAGED,
    Pending,
    SharedSlotGroup,
    TransferError,
    TransferGroup,
)

BACKENDS = ("gloo", "nccl", "native-nccl", "ipc")


def init_transfer_group(
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout: float = 120.0,
    group_name: str = "awex_fast",
    store: object | None = None,
) -> TransferGroup:
    """Join the weight-exchange world as transfer ``rank`` of ``world_size``.

    Rank 0 hosts the rendezvous TCPStore at ``master_addr:master_port``; every other rank
    connects to it. The caller's default process group is neither needed nor touched.
    ``timeout`` (seconds) bounds the rendezvous and is the default for every wait.
    ``group_name`` separates groups sharing one store (use a fresh one, or a fresh port, when
    re-forming a group after a failure). ``store``: an existing TCPStore to rendezvous on instead
    of creating one (rank 0 may bind port 0 itself and publish the port it got).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    if backend == "native-nccl":
        from awex_fast.transport.nccl import NativeNcclGroup

        return NativeNcclGroup(rank, world_size, master_addr, master_port, timeout, group_name, store=store)
    if backend == "ipc":
        from awex_fast.transport.ipc import IpcTransferGroup

        return IpcTransferGroup(rank, world_size, master_addr, master_port, timeout, group_name, store=store)
    from awex_fast.transport.torch_dist import TorchTransferGroup

    return TorchTransferGroup(backend, rank, world_size, master_addr, master_port, timeout, group_name, store)


def init_transfer_group_on_free_port(
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str,
    publish_port: Callable[[int], None],
    await_port: Callable[[], int | tuple[str, int]],
    timeout: float = 120.0,
    group_name: str = "awex_fast",
) -> tuple[TransferGroup, object | None]:
    """`init_transfer_group` where transfer rank 0 binds the rendezvous store on a port the OS
    picks, so no two groups race for a port: rank 0 hands the port to ``publish_port(port)`` and
    every other rank learns it from ``await_port()`` (a KV store, a parent's store, ...); where
    that returns (address, port), the other ranks connect to the address rank 0 bound, whatever
    their own ``master_addr`` says (on another host it may not know it).

    Returns the group and the TCPStore rank 0 hosts (None elsewhere); the group keeps it alive.
    """
    store = None
    if rank == 0:
        import torch.distributed as dist

        from awex_fast.transport.base import timedelta

        store = dist.TCPStore(master_addr, 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(timeout))
        port = store.port
        publish_port(port)
    else:
        got = await_port()
        if isinstance(got, tuple):
            master_addr, port = str(got[0]), int(got[1])
        else:
            port = int(got)
    group = init_transfer_group(backend, rank, world_size, master_addr, port, timeout, group_name, store)
    return group, store


__all__ = [
    "BACKENDS",
    "SHARED_SLOTS",
    "STAGED",
    "Pending",
    "SharedSlotGroup",
    "TransferError",
    "TransferGroup",
    "init_transfer_group",
    "init_transfer_group_on_free_port",
]
