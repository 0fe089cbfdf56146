"""gloo (CPU tensors) and nccl (CUDA tensors) through torch.distributed's own process-group
classes, built on the transfer group's private store: the caller's default process group, if any,
is never touched."""

from __future__ import annotations

import ipaddress
import os
import socket

import torch
import torch.distributed as dist

from awex_fast.transport.base import STAGED, check_peer, make_store, timedelta


class _TorchPending:
    def __init__(self, work: dist.Work, what: str) -> None:
        self._work, self._what = work, what

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(timedelta(timeout_s))
        except RuntimeError as exc:
            text = str(exc)
            if "imed out" in text or "timeout" in text.lower():
                raise TimeoutError(f"{self._what} timed out after {timeout_s:.1f}s: {text}") from exc
            raise


def _gloo_options(master_addr: str, timeout_s: float) -> dist.ProcessGroupGloo._Options:
    """Gloo device: GLOO_SOCKET_IFNAME when set, loopback for a loopback master, else the address
    of the interface this host reaches the master through (the hostname's address may be on
    another network, or none this host's peers can reach), else the host's default device."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(timeout_s)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        loopback = ipaddress.ip_address(master_addr).is_loopback
    except ValueError:
        loopback = master_addr == "localhost"
    if ifname:
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname)]
    elif loopback:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        local = address_towards(master_addr)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local) if local else
                         dist.ProcessGroupGloo.create_default_device()]
    return opts


def address_towards(host: str) -> str | None:
    """This host's address on the route to ``host`` (no packet is sent), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


class TorchTransferGroup:
    """A TransferGroup over ``torch.distributed.ProcessGroupGloo`` or ``ProcessGroupNCCL``."""

    strategy = STAGED

    def __init__(
        self,
        backend: str,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        group_name: str = "awex_fast",
        store: dist.Store | None = None,
    ) -> None:
        self.backend, self.rank, self.world_size, self.timeout_s = backend, rank, world_size, timeout_s
        self.store = make_store(
            master_addr, master_port, rank, world_size, timeout_s, f"{group_name}/", store
        )
        pg_store = dist.PrefixStore("pg/", self.store)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(
                pg_store, rank, world_size, _gloo_options(master_addr, timeout_s)
            )
        elif backend == "nccl":
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise RuntimeError("the nccl backend needs a CUDA build of torch with NCCL")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(timeout_s)
            self._pg = dist.ProcessGroupNCCL(pg_store, rank, world_size, opts)
        else:
            raise ValueError(f"unknown torch.distributed backend {backend!r} (gloo or nccl)")
        self._closed = False

    def _check(self, tensor: torch.Tensor, peer: int) -> None:
        check_peer(self, peer, self._closed)
        if not tensor.is_contiguous():
            raise ValueError("transfer buffers must be contiguous")
        if self.backend == "gloo" and tensor.device.type != "cpu":
            raise ValueError(f"the gloo backend moves CPU tensors; got one on {tensor.device}")
        if self.backend == "nccl" and tensor.device.type != "cuda":
            raise ValueError(f"the nccl backend moves CUDA tensors; got one on {tensor.device}")

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> _TorchPending:
        """Start sending ``tensor`` to ``peer``."""
        self._check(tensor, peer)
        return _TorchPending(self._pg.send([tensor], peer, tag), f"send to rank {peer}")

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> _TorchPending:
        """Start receiving into ``tensor`` from ``peer``."""
        self._check(tensor, peer)
        return _TorchPending(self._pg.recv([tensor], peer, tag), f"receive from rank {peer}")

    def join_current_stream(self) -> None:
        """Nothing to do: a receive's wait already orders torch's current stream after it."""

    def abort(self) -> None:
        """Tear the group down after a failure; pending operations fail or are abandoned."""
        if self._closed:
            return
        self._closed = True
        abort = getattr(self._pg, "abort", None)
        if abort is not None:
            abort()
        self._pg = None

    def close(self) -> None:
        """Leave the group."""
        if self._closed:
            return
        self._closed = True
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self._pg = None
