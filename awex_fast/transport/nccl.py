"""native-nccl: point-to-point over NCCL loaded by the native core with dlopen.

Why not torch.distributed's NCCL: a separate communicator on a dedicated stream whose waits can
time out and call ncclCommAbort, with no dependency on how (or whether) the caller's torch was
built with NCCL. The unique id travels through the transfer group's rendezvous store as raw
bytes. Library search order: AWEX_FAST_NCCL_LIBRARY if set, then every libnccl.so* inside the
nvidia-nccl-cu12 / -cu13 wheels (the ``nvidia`` namespace package), then the bare soname
libnccl.so.2 for the system search path.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import torch

from awex_fast._native import native
from awex_fast.transport.base import STAGED, make_store, timedelta


def nccl_candidates() -> list[str]:
    """Paths tried, in order, to load libnccl."""
    out = []
    env = os.environ.get("AWEX_FAST_NCCL_LIBRARY")
    if env:
        out.append(env)
    for package in ("nvidia.nccl", "nvidia"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        roots = spec.submodule_search_locations if spec is not None else None
        for root in roots or []:
            for lib in sorted(Path(root).glob("**/libnccl.so*")):
                out.append(str(lib))
    out.append("libnccl.so.2")
    return list(dict.fromkeys(out))


def load_nccl() -> dict:
    """Load NCCL (once) and return {"path", "version"}; RuntimeError naming every path tried."""
    return dict(native().nccl.load(nccl_candidates()))


class _NcclPending:
    def __init__(self, comm: object, event: int, what: str) -> None:
        self._comm, self._event, self._what, self._done = comm, event, what, False

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while not self._done:
            if self._comm.query(self._event):
                self._done = True
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._what} timed out after {timeout_s:.1f}s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class NativeNcclGroup:
    """A TransferGroup over a dlopen'ed NCCL communicator on its own CUDA stream."""

    backend = "native-nccl"
    strategy = STAGED

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        group_name: str = "awex_fast",
        device: int | None = None,
        store: object | None = None,
    ) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.info = load_nccl()
        self.store = make_store(
            master_addr, master_port, rank, world_size, timeout_s, f"{group_name}/", store
        )
        if rank == 0:
            self.store.set("nccl_unique_id", native().nccl.unique_id())
        uid = self.store.get("nccl_unique_id")
        self.device = torch.cuda.current_device() if device is None else device
        # ncclCommInitRank (blocking communicator) waits for every rank with no timeout of its
        # own, so first check through the store, with a timeout, that every rank got this far:
        # a rank that died or never started then fails here instead of hanging the others.
        self.store.set(f"nccl_joined_rank{rank}", b"1")
        joined = [f"nccl_joined_rank{r}" for r in range(world_size)]
        try:
            self.store.wait(joined, timedelta(timeout_s))
        except RuntimeError as exc:  # torch's DistStoreError on timeout
            missing = [r for r, key in enumerate(joined) if not self.store.check([key])]
            raise TimeoutError(
                f"native-nccl rank {rank}: ranks {missing} did not join within {timeout_s:.1f}s"
            ) from exc
        self._comm = native().nccl.Comm(bytes(uid), world_size, rank, self.device)

    def _submit(self, ops: list[tuple[bool, torch.Tensor, int]], what: str) -> _NcclPending:
        """Validate ``(is_send, tensor, peer)`` ops and queue them as one NCCL group after the
        caller's current stream; the one path behind isend/irecv and `post_group`."""
        if self._comm is None:
            raise RuntimeError("native-nccl transfer group was closed or aborted")
        for _, t, peer in ops:
            # The communicator, its stream and the producer stream all live on self.device; a
            # tensor elsewhere would fail deep in CUDA with "invalid resource handle".
            if t.device.type != "cuda" or not t.is_contiguous():
                raise ValueError("native-nccl moves contiguous CUDA tensors")
            if t.device.index is not None and t.device.index != self.device:
                raise ValueError(
                    f"native-nccl group is on cuda:{self.device} but the tensor is on {t.device}"
                )
            if not 0 <= peer < self.world_size:
                raise ValueError(f"peer {peer} outside a {self.world_size}-rank group")
        producer = torch.cuda.current_stream(self.device).cuda_stream
        raw = [(s, t.data_ptr(), t.numel() * t.element_size(), p) for s, t, p in ops]
        return _NcclPending(self._comm, self._comm.post(raw, producer), what)

    def _post(self, tensor: torch.Tensor, peer: int, is_send: bool) -> _NcclPending:
        what = f"{'send to' if is_send else 'receive from'} rank {peer}"
        return self._submit([(is_send, tensor, peer)], what)

    def post_group(self, ops: list[tuple[bool, torch.Tensor, int]]) -> _NcclPending:
        """Queue several sends/receives ``(is_send, tensor, peer)`` as one NCCL group (needed for
        a send and a receive between the same pair, e.g. to this rank itself)."""
        return self._submit(ops, f"{len(ops)} grouped operations")

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> _NcclPending:
        """Queue a send of ``tensor`` after the current stream's work (NCCL orders by issue, so
        ``tag`` only documents the bucket)."""
        return self._post(tensor, peer, True)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> _NcclPending:
        """Queue a receive into ``tensor``; after wait(), call `join_current_stream` before use."""
        return self._post(tensor, peer, False)

    def join_current_stream(self) -> None:
        """Make torch's current stream wait for every receive queued so far."""
        self._comm.join(torch.cuda.current_stream(self.device).cuda_stream)

    def abort(self) -> None:
        """ncclCommAbort: pending operations are cancelled."""
        if self._comm is not None:
            self._comm.close(True)
            self._comm = None

    def close(self) -> None:
        """ncclCommDestroy."""
        if self._comm is not None:
            self._comm.close(False)
            self._comm = None
