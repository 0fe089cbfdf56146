"""What both awex adapters share (`awex_fast.sync.adapters`): KV access, the world's metadata,
this rank's plan, the transfer group and its executor, the warm-up, colocated state and memory
release. The protocol they implement, and its contract, is `awex_fast.sync.protocol`.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from awex_fast.meta import ParameterMeta, with_rank_offset
from awex_fast.net import ADMIN_KEY_ENV, KVStoreClient
from awex_fast.plan import build_plan
from awex_fast.sync.colocate import ColocateReceiver, ColocateSender, plan_boxes
from awex_fast.sync.join import (
    assemble_world,
    check_own_pieces,
    form_transfer_group,
    publish_digest,
    wait_value,
)
from awex_fast.sync.memory import MemoryTags, OffloadStore
from awex_fast.sync.protocol import AREAL_DEFAULT_ADMIN_KEY, INFER_META_KEY, TRAINING_META_KEY
from awex_fast.transfer.executor import Executor, metadata_fingerprints, wire_buckets
from awex_fast.transport import TransferError

WARMUP_TAG = 1 << 30  # gloo message tag of the warm-up exchange (bucket tags count from 0)
_COLOCATE_BUCKET_BYTES = 1 << 40  # colocated copies are never bucketed: keep ops whole
Hooks = Mapping[str, tuple[Callable[[], Any], Callable[[], Any]]] | None  # tag -> (release, resume)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's detached memory of ``t`` (``to_local()`` of a DTensor)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return t.to_local().detach() if isinstance(t, DTensor) else t.detach()


def default_rank() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class AdapterBase(abc.ABC):
    """What both sides share: KV access, plan, transfer group, executor, warm-up, colocated
    state, memory release. Subclasses provide the tensor source and the send/receive specifics."""

    role = "?"

    def __init__(self, *, rank: int, admin_api_key: str | None, backend: str, timeout_s: float,
                 bucket_bytes: int, verify: bool, offload_dir: str | None, release_hooks: Hooks) -> None:
        self.rank = int(rank)
        self.admin_api_key = os.environ.get(ADMIN_KEY_ENV) if admin_api_key is None else admin_api_key
        self.backend, self.timeout_s = backend, float(timeout_s)
        self.bucket_bytes, self.verify = int(bucket_bytes), bool(verify)
        self._store = OffloadStore(offload_dir)
        self._memory = MemoryTags(self._store, release_hooks)
        self._lock = threading.RLock()
        self._kv: KVStoreClient | None = None
        self._kv_key: str | None = None
        self._executor: Executor | None = None
        self._tcp_store: Any = None
        self._sender: ColocateSender | None = None
        self._receiver: ColocateReceiver | None = None
        self.transfer_rank: int | None = None
        self.failed = False
        self.last_error: str | None = None

    # --- sources (subclasses) -------------------------------------------------------------------

    @abc.abstractmethod
    def _named(self) -> list[tuple[str, torch.Tensor]]:
        """Canonical name -> local tensor pairs of this worker's source."""

    @abc.abstractmethod
    def get_weight_metadata(self) -> list[ParameterMeta]:
        """This worker's pieces in side-local ranks (see the subclass)."""

    def get_local_shard_parameters(self, required_names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Canonical name -> local tensor (``to_local()`` of DTensors), only ``required_names``
        when given; a required name this worker lacks raises KeyError naming it."""
        out = {n: local_tensor(t) for n, t in self._named()}
        if required_names is None:
            return out
        missing = sorted(set(required_names) - out.keys())
        if missing:
            raise KeyError(f"{self.role} rank {self.rank} has no tensors named {missing[:5]}")
        return {n: out[n] for n in required_names}

    # --- KV and world ---------------------------------------------------------------------------

    def _kv_client(self, url: str, key: str | None = None) -> KVStoreClient:
        key = self.admin_api_key if key is None else key
        if self._kv is None or self._kv.url != url.rstrip("/") or key != self._kv_key:
            if self._kv is not None:
                self._kv.close()
            self._kv = KVStoreClient(url, "" if key is None else key)
            self._kv_key = key
        return self._kv

    def _world(self, kv: KVStoreClient, pair_name: str, infer_world_size: int, train_world_size: int,
               num_engines: int, transfer_rank: int) -> tuple[list[ParameterMeta], list[ParameterMeta], int]:
        """(training metas, inference metas) in transfer ranks, and the bucket size to plan with
        (the published one, else this adapter's)."""
        train_v = wait_value(kv, pair_name, TRAINING_META_KEY, self.timeout_s, rank=transfer_rank,
                             step=f"wait for {TRAINING_META_KEY}", who="the training side")
        infer_v = wait_value(kv, pair_name, INFER_META_KEY, self.timeout_s, rank=transfer_rank,
                             step=f"wait for {INFER_META_KEY}", who="the inference side")
        train, infer = assemble_world(train_v, infer_v, infer_world_size=infer_world_size,
                                      train_world_size=train_world_size, num_engines=num_engines)
        return train, infer, int(train_v.get("bucket_bytes") or self.bucket_bytes)

    def _check_transfer_rank(self, transfer_rank: int, infer_world_size: int, world_size: int) -> None:
        lo, hi = (infer_world_size, world_size) if self.role == "training" else (0, infer_world_size)
        if not lo <= transfer_rank < hi:
            raise ValueError(f"{self.role} rank {self.rank}: transfer_rank {transfer_rank} is outside the "
                             f"{self.role} range [{lo}, {hi}) of a {world_size}-rank world")

    def _own_side(self, train: list[ParameterMeta], infer: list[ParameterMeta]) -> list[ParameterMeta]:
        return train if self.role == "training" else infer

    def _join(self, kv: KVStoreClient, pair: str, addr: str, port: int, rank: int, world: int) -> Any:
        group, self._tcp_store = form_transfer_group(kv, pair, self.backend, addr, port, rank, world,
                                                     self.timeout_s)
        return group

    # --- transfer path --------------------------------------------------------------------------

    def init_weight_update_group(self, pair_name: str, master_addr: str, master_port: int, transfer_rank: int,
                                 world_size: int, kv_store_url: str, infer_world_size: int,
                                 train_world_size: int, num_engines: int) -> dict[str, Any]:
        """See the module docstring (step 3). Returns {"transfer_rank", "digest", "peers",
        "send_bytes", "recv_bytes", "plan_seconds"}; raises `MetadataError` / `PlanError` /
        `TransferError` naming what disagreed."""
        with self._lock:
            self._teardown_locked()
            try:
                return self._init_group(pair_name, master_addr, master_port, transfer_rank, world_size,
                                        kv_store_url, infer_world_size, train_world_size, num_engines)
            except BaseException:
                self._teardown_locked()  # nothing half-built stays behind (KV client, store)
                raise

    def _init_group(self, pair_name: str, master_addr: str, master_port: int, transfer_rank: int,
                    world_size: int, kv_store_url: str, infer_world_size: int, train_world_size: int,
                    num_engines: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        if world_size != infer_world_size + train_world_size:
            raise ValueError(f"world_size {world_size} != infer_world_size {infer_world_size} + "
                             f"train_world_size {train_world_size}")
        self._check_transfer_rank(transfer_rank, infer_world_size, world_size)
        kv = self._kv_client(kv_store_url)
        train, infer, bucket_bytes = self._world(kv, pair_name, infer_world_size, train_world_size,
                                                 num_engines, transfer_rank)
        mine = with_rank_offset(self.get_weight_metadata(), transfer_rank - self.rank)
        check_own_pieces(self._own_side(train, infer), mine, transfer_rank)
        plan = build_plan(train, infer, bucket_bytes)
        rank_plan = plan.for_rank(transfer_rank)
        digest = plan.digest()
        publish_digest(kv, pair_name, transfer_rank, digest)
        buckets = wire_buckets(rank_plan)
        needed = sorted({op.name for b in buckets for op in b.ops})
        group = self._join(kv, pair_name, master_addr, master_port, transfer_rank, world_size)
        try:
            with self._resident():
                tensors = self.get_local_shard_parameters(needed)
            ex = Executor(buckets, tensors, group, digest=digest, verify=self.verify,
                          timeout_s=self.timeout_s,
                          fingerprints=lambda: metadata_fingerprints([("train", train), ("infer", infer)]))
            ex.handshake()
        except BaseException:
            group.abort()
            self._tcp_store = None
            raise
        self._executor, self.transfer_rank = ex, transfer_rank
        self.failed, self.last_error = False, None
        return {"transfer_rank": transfer_rank, "digest": digest, "peers": ex.peers(),
                "send_bytes": rank_plan.send_bytes, "recv_bytes": rank_plan.recv_bytes,
                "plan_seconds": time.perf_counter() - t0}

    @property
    def executor(self) -> Executor:
        """The executor of the current transfer group (raises until one is formed, or after a
        failed update tore it down)."""
        return self._require_executor()

    def _require_executor(self) -> Executor:
        if self._executor is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: no transfer group; "
                               "call init_weight_update_group first")
        if self.failed:
            raise TransferError(f"{self.role} rank {self.rank}: the transfer group was torn down after a "
                                "failed update; call teardown_weight_update_group() and "
                                f"init_weight_update_group() on a fresh port (last error: {self.last_error})")
        return self._executor

    def batch_isend_irecv(self, **kwargs: Any) -> dict[str, Any]:
        """Warm-up: every sender sends its transfer rank to every receiver of its plan (one
        direction, so NCCL's in-order streams cannot deadlock); receivers check who answered.
        ``timeout_s`` overrides the adapter's timeout. Returns {"peers", "seconds"}."""
        with self._lock:
            ex = self._require_executor()
            timeout = float(kwargs.get("timeout_s", self.timeout_s))
            t0 = time.perf_counter()
            try:
                self._warm_up(ex, timeout)
            except (TransferError, RuntimeError, ValueError) as exc:
                self._fail(exc)
                ex.group.abort()
                raise
            return {"peers": ex.peers(), "seconds": time.perf_counter() - t0}

    def _warm_up(self, ex: Executor, timeout: float) -> None:
        peers, group, sending = ex.peers(), ex.group, self.role == "training"
        bufs = {p: torch.full((1,), -1, dtype=torch.int64, device=ex.device) for p in peers}
        mine = torch.full((1,), int(self.transfer_rank), dtype=torch.int64, device=ex.device)
        pending = [(p, group.isend(mine, p, WARMUP_TAG) if sending else group.irecv(bufs[p], p, WARMUP_TAG))
                   for p in peers]
        for p, work in pending:
            try:
                work.wait(timeout)
            except (TimeoutError, RuntimeError) as exc:
                raise TransferError(f"{self.role} transfer rank {self.transfer_rank}: warm-up with its peer "
                                    f"failed: {exc}", peer=p) from exc
            if not sending and int(bufs[p].item()) != p:
                raise TransferError(f"warm-up: transfer rank {self.transfer_rank} expected rank {p} but "
                                    f"received {int(bufs[p].item())}", peer=p)

    def _fail(self, exc: BaseException) -> None:
        self.failed, self.last_error = True, f"{type(exc).__name__}: {exc}"

    def _run_transfer(self, version: int) -> dict[str, Any]:
        ex = self._require_executor()
        try:
            with self._resident():
                # the source is read again every round: it may hold new tensors now (a replaced
                # dict, load_state_dict(assign=True), a re-published checkpoint), and the round
                # must send (or receive into) those, never the ones bound at the join
                return ex.run(int(version), self.get_local_shard_parameters())
        except TransferError as exc:
            self._fail(exc)
            raise

    def teardown_weight_update_group(self) -> None:
        """Leave the transfer group (abort it after a failure), drop the plan, the colocated
        mappings and the KV client. Idempotent; the adapter can be initialised again."""
        with self._lock:
            self._teardown_locked()

    def _teardown_locked(self) -> None:
        ex, self._executor = self._executor, None
        if ex is not None:
            with contextlib.suppress(RuntimeError):
                if self.failed:
                    ex.group.abort()
                else:
                    ex.group.close()
        self._tcp_store = None
        if self._receiver is not None:
            self._receiver.close()
        self._sender = self._receiver = None
        self.transfer_rank = None
        if self._kv is not None:
            self._kv.close()
            self._kv = None

    # --- colocated path -------------------------------------------------------------------------

    def init_colocate_weight_update(self, pair_name: str, kv_store_url: str, transfer_rank: int,
                                    infer_world_size: int, train_world_size: int, num_engines: int,
                                    master_port: int, admin_api_key: str = AREAL_DEFAULT_ADMIN_KEY,
                                    timeout_s: float = 120.0) -> dict[str, Any]:
        """Prepare colocated updates: fetch the world's metadata, plan this rank's boxes (one op
        per box, never bucketed), and on the training side put CPU weights in shared memory.
        ``admin_api_key``: the KV store's key; the AReaL default means "use the adapter's own key
        if it has one". ``master_port`` is unused (no transfer group)."""
        del master_port
        with self._lock:
            self._teardown_locked()
            try:
                return self._init_colocate(pair_name, kv_store_url, transfer_rank, infer_world_size,
                                           train_world_size, num_engines, admin_api_key, timeout_s)
            except BaseException:
                self._teardown_locked()
                raise

    def _init_colocate(self, pair_name: str, kv_store_url: str, transfer_rank: int, infer_world_size: int,
                       train_world_size: int, num_engines: int, admin_api_key: str,
                       timeout_s: float) -> dict[str, Any]:
        world = infer_world_size + train_world_size
        self._check_transfer_rank(transfer_rank, infer_world_size, world)
        key = admin_api_key if admin_api_key != AREAL_DEFAULT_ADMIN_KEY or not self.admin_api_key else None
        kv = self._kv_client(kv_store_url, key)
        self.timeout_s = float(timeout_s)
        train, infer, _ = self._world(kv, pair_name, infer_world_size, train_world_size, num_engines,
                                      transfer_rank)
        mine = with_rank_offset(self.get_weight_metadata(), transfer_rank - self.rank)
        check_own_pieces(self._own_side(train, infer), mine, transfer_rank)
        rank_plan = build_plan(train, infer, _COLOCATE_BUCKET_BYTES).for_rank(transfer_rank)
        self.transfer_rank = transfer_rank
        if self.role == "training":
            self._prepare_colocate()
            readers = len({b.peer for b in rank_plan.sends})
            self._sender = ColocateSender(kv, pair_name, transfer_rank, readers, self.timeout_s)
            peers = sorted({b.peer for b in rank_plan.sends})
        else:
            boxes = plan_boxes(rank_plan)
            self._receiver = ColocateReceiver(kv, pair_name, transfer_rank, boxes, self.timeout_s)
            peers = self._receiver.peers
        self.failed, self.last_error = False, None
        return {"transfer_rank": transfer_rank, "peers": peers}

    def _prepare_colocate(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Training side: make the local tensors publishable (subclasses move CPU params)."""

    # --- memory ---------------------------------------------------------------------------------

    @property
    def memory_tags(self) -> list[str]:
        """Tags `release_memory` understands here."""
        return sorted({"weights", *self._extra_tags(), *self._memory.hooks})

    def _extra_tags(self) -> list[str]:
        return []

    def _release_tensors(self, tag: str) -> tuple[list[torch.Tensor], bool]:
        """(tensors whose storage ``tag`` frees, whether their contents are kept)."""
        raise ValueError(f"release_memory: unknown tag {tag!r}; this adapter releases {self.memory_tags}")

    def release_memory(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Free the memory of ``tags`` (default: every tag in `memory_tags`); a tag already
        released is skipped. Returns {"released": {tag: bytes or None for hooks}, "skipped",
        "rss_before", "rss_after"} (RSS of this process, bytes), and with CUDA in use
        "cuda_allocated_before" / "cuda_allocated" (torch.cuda.memory_allocated)."""
        with self._lock:
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            before = torch.cuda.memory_allocated() if cuda else None
            out = self._memory.release(self.memory_tags if tags is None else tags, self._release_tensors)
            if cuda:
                out["cuda_allocated_before"], out["cuda_allocated"] = before, torch.cuda.memory_allocated()
            return out

    def resume_memory(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Restore what `release_memory` freed for ``tags`` (default: every released tag).
        Returns {"resumed": {tag: bytes or None}, "rss_after"}."""
        with self._lock:
            return self._memory.resume(tags, self._after_resume)

    def _after_resume(self, tag: str) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called after `resume_memory` restored ``tag`` (subclasses republish handles)."""

    @contextlib.contextmanager
    def _resident(self) -> Any:
        """Training weights that were released come back for the duration of an update."""
        if self.role != "training" or "weights" not in self._store.released_tags:
            yield
            return
        self._store.resume("weights")
        self._after_resume("weights")
        try:
            yield
        finally:
            tensors, keep = self._release_tensors("weights")
            self._store.release("weights", tensors, keep=keep)




__all__ = ["AdapterBase", "Hooks", "default_rank", "local_tensor"]
