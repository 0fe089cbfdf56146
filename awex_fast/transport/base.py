"""What every transfer backend offers the executor: point-to-point sends and receives of raw
buffers between transfer ranks, waits with timeouts, a rendezvous store, and abort.

A `TransferGroup` is stateless with respect to the caller's own process groups: it is built from
its own TCPStore (hosted by transfer rank 0 at master_addr:master_port) under its own prefix, so a
training job and inference engines, each with its default world already initialised, can join
one exchange world without touching those worlds (the role vLLM's StatelessProcessGroup and
AReaL's custom process group play).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class TransferError(RuntimeError):
    """A transfer failed or timed out. Names the peer, the bucket, the parameters the message
    carried and the version when known; ``detail`` is the message without them."""

    def __init__(
        self,
        message: str,
        *,
        peer: int | None = None,
        bucket: int | None = None,
        version: int | None = None,
        params: Sequence[str] = (),
    ) -> None:
        parts = [message]
        if peer is not None:
            parts.append(f"peer={peer}")
        if bucket is not None:
            parts.append(f"bucket={bucket}")
        if params:
            more = f" (+{len(params) - 3} more)" if len(params) > 3 else ""
            parts.append(f"parameters={', '.join(params[:3])}{more}")
        if version is not None:
            parts.append(f"version={version}")
        super().__init__(" ".join(parts) if len(parts) == 1 else f"{message} ({', '.join(parts[1:])})")
        self.detail = message
        self.peer, self.bucket, self.version, self.params = peer, bucket, version, tuple(params)

    def with_detail(self, detail: str) -> TransferError:
        """The same error (peer, bucket, parameters, version) with ``detail`` as its message."""
        return TransferError(detail, peer=self.peer, bucket=self.bucket, version=self.version,
                             params=self.params)


class Pending(Protocol):
    """An in-flight send or receive."""

    def wait(self, timeout_s: float) -> None:
        """Block until done; raise TimeoutError after ``timeout_s``, or RuntimeError on failure."""
        ...


# How an executor moves messages over a group (`TransferGroup.strategy`):
STAGED = "staged"  # each message is one tensor given to isend / irecv (a staging slot or the
#                    parameter's own memory); the executor packs and unpacks around the wire
SHARED_SLOTS = "shared_slots"  # the group is a `SharedSlotGroup`: senders pack straight into the
#                                receiver's shared slots, receivers unpack straight out of them
STRATEGIES = (STAGED, SHARED_SLOTS)


class TransferGroup(Protocol):
    """A world of transfer ranks exchanging raw buffers.

    ``strategy`` declares how an executor moves messages over the group: `STAGED` for every
    group, or `SHARED_SLOTS` for a group that also satisfies `SharedSlotGroup`."""

    backend: str
    strategy: str
    rank: int
    world_size: int
    timeout_s: float
    store: torch.distributed.Store

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        """Start sending the contiguous ``tensor`` to ``peer``."""
        ...

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        """Start receiving into the contiguous ``tensor`` from ``peer``."""
        ...

    def join_current_stream(self) -> None:
        """Make torch's current stream wait for every receive waited for so far, before the
        received bytes are read on it (a no-op for groups whose waits complete on the host)."""
        ...

    def abort(self) -> None:
        """Fail every pending operation and make the group unusable (after a failure)."""
        ...

    def close(self) -> None:
        """Leave the group cleanly."""
        ...


class SlotChannel(Protocol):
    """The shared slots of one (sender, receiver) pair: message ``tag`` of the pair uses slot
    ``tag % slots``."""

    slots: int

    def slot(self, index: int) -> torch.Tensor:
        """Slot ``index``'s bytes (uint8), stable for the channel's life."""
        ...

    def control_address(self, index: int) -> int:
        """Address of slot ``index``'s control line (what the native runner synchronises on)."""
        ...


class SlotRunner(Protocol):
    """A native replay of one role's messages over shared slots (csrc/shm/runner.cpp)."""

    def run(self, bases: list[int], timeout_s: float, verify: bool) -> tuple[int, int, str, Any, Any]:
        """Run every step once, the chunk numbers of each peer starting at ``bases``; returns
        (status, failed step, detail, per-step times [n, 3], per-step checksums or None)."""
        ...


class SharedSlotGroup(TransferGroup, Protocol):
    """A group whose ranks share memory (``strategy`` is `SHARED_SLOTS`): messages are written
    into, and read from, the receiver's slots, with no staging of the executor's own."""

    def channel(
        self, peer: int, role: str, name: str, slots: int, slot_bytes: int, *, wait: bool = True
    ) -> SlotChannel | None:
        """The (this rank, ``peer``) channel ``name``: the receiver creates it, the sender maps it
        (waiting up to the group's timeout when ``wait``, else None while it does not exist)."""
        ...

    def runner(self, role: str, peers: list[int], steps: list[tuple]) -> SlotRunner:
        """A native runner of ``steps`` ((index into ``peers``, slot control address, slot address,
        tag, nbytes, copy descriptors), in execution order) over this group's channels."""
        ...


def check_peer(group: TransferGroup, peer: int, closed: bool) -> None:
    """Refuse an operation on a ``closed`` group, or with a ``peer`` that is not another rank."""
    if closed:
        raise RuntimeError(f"transfer group ({group.backend}) was closed or aborted")
    if not 0 <= peer < group.world_size or peer == group.rank:
        raise ValueError(f"peer {peer} is not another rank of this {group.world_size}-rank group")


def timedelta(seconds: float) -> datetime.timedelta:
    """``seconds`` as a timedelta (torch.distributed's unit for timeouts)."""
    return datetime.timedelta(seconds=seconds)


def make_store(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    prefix: str,
    store: torch.distributed.Store | None = None,
) -> torch.distributed.Store:
    """The group's rendezvous store: a TCPStore hosted by rank 0, seen through ``prefix`` so that
    several groups (and re-formed groups after a failure) never read each other's keys. A caller
    that already holds a store (e.g. rank 0 bound port 0 and published the port it got) passes it
    as ``store``."""
    import torch.distributed as dist

    if store is not None:
        return dist.PrefixStore(prefix, store)
    tcp = dist.TCPStore(
        master_addr,
        int(master_port),
        world_size,
        is_master=rank == 0,
        timeout=timedelta(timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore(prefix, tcp)
