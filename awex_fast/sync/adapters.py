"""Weight-sync adapters: the two protocols RL frameworks drive, and implementations over any
source of named local tensors.

`AwexTrainingAdapter` and `AwexInferenceAdapter` have exactly the members and arguments of the
protocol AReaL's weight-update gateway drives. `TrainingAdapter` and `InferenceAdapter`
implement them over an ``nn.Module`` (DTensor / FSDP2 / TP or plain parameters) or a callable
returning canonical views (e.g. fused-layout views of an inference engine), so they serve our
engines and anyone else's. What the seed signatures have no place for is taken at construction:
the admin key (default ``$AWEX_FAST_ADMIN_KEY``), a name-mapping function, the transfer backend,
timeouts, bucket size.

Contract (who calls what, in which order, what a failure leaves behind):

1. Every worker reports ``parallelism_strategy`` and ``get_weight_metadata()``, in *side-local*
   ranks (training: the global rank of the training job; inference: the rank inside its engine).
2. Whoever assembles the pair (`awex_fast.sync.pair.WeightSyncPair`, or AReaL's gateway) publishes the
   merged metadata of each side under the KV keys ``training_params_meta`` and
   ``infer_params_meta`` of the pair, as `encode_side_metas` writes them: JSON with one base64
   metas-JSON per engine (and one for the training job) plus the engine sizes, still side-local,
   and optionally the bucket size every rank must plan with.
3. ``init_weight_update_group(...)`` on every worker *concurrently*: each adapter fetches both
   values, shifts them to transfer ranks with ``with_rank_offset`` (engines first, by prefix sums
   of their sizes; training after every inference rank; `assemble_world`), checks that the
   pieces published for its own transfer rank are the ones it reported, builds its own rank's
   plan (``plan.for_rank``; the world's plan is never built), mirrors ``plan_digest_rank{r}`` to
   the KV store, joins the transfer group and compares digests with its peers. ``master_port=0``:
   transfer rank 0 binds a port the OS chooses and publishes it under ``transfer_master_port``
   (the driver must delete that key before re-forming a group).
4. ``batch_isend_irecv()`` on every worker concurrently: every sender sends its rank to every
   receiver of its plan; a dead or wrong peer fails here, not in the first update.
5. Each step, ``execute_weight_update(version)`` on every worker concurrently (never twice for
   one version). The inference side's ``version`` moves only after every bucket landed; a failed
   update raises `TransferError`, aborts the group and leaves the inference adapter *flagged*
   (``failed``, ``last_error``). The next update must first call
   ``teardown_weight_update_group()`` and ``init_weight_update_group(...)`` on a fresh port.

Colocated mode replaces 3-5 with ``init_colocate_weight_update`` and
``execute_colocate_weight_update`` (see `awex_fast.sync.colocate`). ``release_memory`` /
``resume_memory`` really free and restore memory (tags "weights", "optimizer" with an optimizer,
and any tag given a hook, such as an engine's "kv_cache"). Released training weights are resumed
for the duration of an update and released again. Released inference weights are not saved: the
engine refuses generation (`require_weights`) until the next update lands in them.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from awex_fast.meta import (
    MetadataError,
    ParameterMeta,
    merge_metas,
    metas_from_json,
    metas_to_json,
    transfer_ranks,
    with_rank_offset,
)
from awex_fast.net import ADMIN_KEY_ENV, KVStoreClient
from awex_fast.plan import build_plan
from awex_fast.sync.colocate import ColocateReceiver, ColocateSender, plan_boxes, share_tensors
from awex_fast.sync.memory import MemoryTags, OffloadStore
from awex_fast.transfer.executor import Executor, metadata_fingerprints, wire_buckets
from awex_fast.transport import TransferError, init_transfer_group
from awex_fast.transport.shm import find_segment

TRAINING_META_KEY = "training_params_meta"
INFER_META_KEY = "infer_params_meta"
MASTER_PORT_KEY = "transfer_master_port"
SIDE_METAS_FORMAT = "awex_fast.side_metas"
AREAL_DEFAULT_ADMIN_KEY = "areal-admin-key"
WARMUP_TAG = 1 << 30  # gloo message tag of the warm-up exchange (bucket tags count from 0)
_COLOCATE_BUCKET_BYTES = 1 << 40  # colocated copies are never bucketed: keep ops whole
_Metas = Sequence[ParameterMeta] | Callable[[], Sequence[ParameterMeta]] | None
_Hooks = Mapping[str, tuple[Callable[[], Any], Callable[[], Any]]] | None  # tag -> (release, resume)


def digest_key(transfer_rank: int) -> str:
    """KV key where transfer rank ``transfer_rank`` mirrors its plan digest (DESIGN.md)."""
    return f"plan_digest_rank{transfer_rank}"


class _AwexAdapter(Protocol):
    """The members both sides share, with the seed protocol's exact arguments."""

    @property
    def parallelism_strategy(self) -> dict:
        """world_size, tp_size, pp_size, dp_size, ep_size (and rank) of this worker's job/engine."""
        ...

    def get_weight_metadata(self) -> list:
        """This worker's pieces, canonical names, side-local rank: list[ParameterMeta]."""
        ...

    def get_local_shard_parameters(self, required_names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Canonical name -> this worker's local tensor or view (the memory the pieces index)."""
        ...

    def init_weight_update_group(self, pair_name: str, master_addr: str, master_port: int, transfer_rank: int,
                                 world_size: int, kv_store_url: str, infer_world_size: int,
                                 train_world_size: int, num_engines: int) -> None:
        """Pull peer metadata from the KV store, build this rank's plan, join the transfer group."""
        ...

    def execute_weight_update(self, version: int) -> None:
        """Run the cached plan (send, or receive and then move the version)."""
        ...

    def batch_isend_irecv(self, **kwargs: Any) -> None:
        """Warm-up exchange proving every peer of the plan answers."""
        ...

    def teardown_weight_update_group(self) -> None:
        """Leave the transfer group, drop cached state."""
        ...

    def init_colocate_weight_update(self, pair_name: str, kv_store_url: str, transfer_rank: int,
                                    infer_world_size: int, train_world_size: int, num_engines: int,
                                    master_port: int, admin_api_key: str = "areal-admin-key",
                                    timeout_s: float = 120.0) -> None:
        """Prepare colocated updates (handles through the KV store)."""
        ...

    def execute_colocate_weight_update(self, version: int) -> None:
        """Training: publish handles, wait for acks. Inference: map, copy, acknowledge."""
        ...

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free memory ("weights", "optimizer", "kv_cache", ...)."""
        ...

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Restore what release_memory freed."""
        ...


@runtime_checkable
class AwexTrainingAdapter(_AwexAdapter, Protocol):
    """Training side of a weight-sync pair (sends weights); see the module docstring."""


@runtime_checkable
class AwexInferenceAdapter(_AwexAdapter, Protocol):
    """Inference side of a weight-sync pair (receives weights); same members as the training side."""


class WeightsNotReadyError(RuntimeError):
    """Inference weights are released or the last update failed; generation must wait."""


# --------------------------------------------------------------------------------------------
# Side metadata in the KV store
# --------------------------------------------------------------------------------------------


def encode_side_metas(side: str, groups: Sequence[Sequence[ParameterMeta]], sizes: Sequence[int], *,
                      bucket_bytes: int | None = None) -> dict:
    """The KV value of ``training_params_meta`` (side "training", one group: the job) or
    ``infer_params_meta`` (side "inference", one group per engine, in engine order): side-local
    ranks, each group's metas JSON base64-encoded inside the JSON value. ``bucket_bytes`` (in
    the training value) makes every rank plan with one bucket size, whatever it was built with."""
    if side not in ("training", "inference"):
        raise ValueError(f"side must be 'training' or 'inference', got {side!r}")
    if len(groups) != len(sizes):
        raise ValueError(f"{side}: {len(groups)} metadata groups but {len(sizes)} sizes")
    value = {"format": SIDE_METAS_FORMAT, "version": 1, "side": side, "rank_space": "side_local",
             "sizes": [int(s) for s in sizes],
             "metas": [base64.b64encode(metas_to_json(g)).decode("ascii") for g in groups]}
    if bucket_bytes is not None:
        value["bucket_bytes"] = int(bucket_bytes)
    return value


def decode_side_metas(value: Any, side: str) -> tuple[list[int], list[list[ParameterMeta]]]:
    """Inverse of `encode_side_metas`: (sizes, per-group metas). Raises `MetadataError` naming
    the defect (wrong format or side, sizes and groups that disagree, a rank outside its group)."""
    if not isinstance(value, dict) or value.get("format") != SIDE_METAS_FORMAT or value.get("version") != 1:
        raise MetadataError(f"{side} metadata in the KV store is not {SIDE_METAS_FORMAT} version 1: "
                            f"{str(value)[:120]}")
    if value.get("side") != side:
        raise MetadataError(f"KV value for the {side} side says side={value.get('side')!r}")
    sizes, blobs = value.get("sizes"), value.get("metas")
    if not isinstance(sizes, list) or not isinstance(blobs, list) or len(sizes) != len(blobs) or not sizes:
        raise MetadataError(f"{side} metadata: 'sizes' and 'metas' must be equal-length non-empty lists")
    groups = []
    for g, (size, blob) in enumerate(zip(sizes, blobs, strict=True)):
        try:
            metas = metas_from_json(base64.b64decode(blob, validate=True))
        except (ValueError, TypeError) as exc:
            raise MetadataError(f"{side} group {g}: metadata is not base64 metas JSON: {exc}") from None
        for m in metas:
            high = max(m.ranks(), default=-1)
            if high >= size:
                raise MetadataError(f"{side} group {g} (size {size}): parameter {m.name!r} names rank {high}")
        groups.append(metas)
    return [int(s) for s in sizes], groups


def assemble_world(train_value: Any, infer_value: Any, *, infer_world_size: int, train_world_size: int,
                   num_engines: int) -> tuple[list[ParameterMeta], list[ParameterMeta]]:
    """Both sides' metadata in transfer ranks: engine ``e``'s local rank ``r`` becomes
    ``base[e] + r`` (prefix sums of the engine sizes), training rank ``t`` becomes
    ``infer_world_size + t``. Sizes that disagree with the arguments raise `MetadataError`."""
    engine_sizes, engines = decode_side_metas(infer_value, "inference")
    train_sizes, train_groups = decode_side_metas(train_value, "training")
    if len(engine_sizes) != num_engines or sum(engine_sizes) != infer_world_size:
        raise MetadataError(f"published inference sizes {engine_sizes} disagree with "
                            f"num_engines={num_engines}, infer_world_size={infer_world_size}")
    if sum(train_sizes) != train_world_size:
        raise MetadataError(f"published training sizes {train_sizes} disagree with "
                            f"train_world_size={train_world_size}")
    bases, train_base = transfer_ranks(engine_sizes, train_world_size)
    infer = merge_metas([with_rank_offset(g, b) for g, b in zip(engines, bases, strict=True)])
    tbases = [train_base + sum(train_sizes[:i]) for i in range(len(train_sizes))]
    train = merge_metas([with_rank_offset(g, b) for g, b in zip(train_groups, tbases, strict=True)])
    return train, infer


def _pieces_key(pieces: Iterable[Any]) -> list[tuple]:
    return sorted((p.global_offset, p.shape, p.local) for p in pieces)


def check_own_pieces(published: Sequence[ParameterMeta], mine: Sequence[ParameterMeta],
                     transfer_rank: int) -> None:
    """Raise `MetadataError` unless the pieces ``published`` for ``transfer_rank`` are exactly
    ``mine`` (already shifted to transfer ranks): catches a worker given another's rank."""
    by_name = {m.name: m for m in published}
    own = {m.name for m in mine if m.pieces_for_rank(transfer_rank)}
    for m in mine:
        want = _pieces_key(m.pieces_for_rank(transfer_rank))
        pub = by_name.get(m.name)
        got = _pieces_key(pub.pieces_for_rank(transfer_rank)) if pub is not None else []
        if got != want:
            raise MetadataError(f"transfer rank {transfer_rank}: parameter {m.name!r} is published with "
                                f"pieces {got[:3]} for this rank but this worker holds {want[:3]}")
    extra = sorted(m.name for m in published if m.name not in own and transfer_rank in m.ranks())
    if extra:
        raise MetadataError(f"transfer rank {transfer_rank}: the published metadata gives this rank "
                            f"parameters it does not hold: {extra[:5]}")


# --------------------------------------------------------------------------------------------
# Shared implementation
# --------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return t.to_local().detach() if isinstance(t, DTensor) else t.detach()


def _default_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _AdapterBase(abc.ABC):
    """What both sides share: KV access, plan, transfer group, executor, warm-up, colocated
    state, memory release. Subclasses provide the tensor source and the send/receive specifics."""

    role = "?"

    def __init__(self, *, rank: int, admin_api_key: str | None, backend: str, timeout_s: float,
                 bucket_bytes: int, verify: bool, offload_dir: str | None, release_hooks: _Hooks) -> None:
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
        out = {n: _local(t) for n, t in self._named()}
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
               num_engines: int) -> tuple[list[ParameterMeta], list[ParameterMeta], int]:
        """(training metas, inference metas) in transfer ranks, and the bucket size to plan with
        (the published one, else this adapter's)."""
        train_v = kv.wait(pair_name, TRAINING_META_KEY, self.timeout_s)
        infer_v = kv.wait(pair_name, INFER_META_KEY, self.timeout_s)
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
        store = None
        if int(port) == 0:  # rank 0 binds a port the OS chooses and publishes it
            if rank == 0:
                import torch.distributed as dist

                from awex_fast.transport.base import timedelta

                store = dist.TCPStore(addr, 0, world, is_master=True, wait_for_workers=False,
                                      timeout=timedelta(self.timeout_s))
                port = store.port
                kv.put(pair, MASTER_PORT_KEY, {"addr": addr, "port": port})
            else:
                port = int(kv.wait(pair, MASTER_PORT_KEY, self.timeout_s)["port"])
        self._tcp_store = store
        return init_transfer_group(self.backend, rank, world, addr, int(port), timeout=self.timeout_s,
                                   group_name=f"awex_{pair}", store=store)

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
                                                 num_engines)
        mine = with_rank_offset(self.get_weight_metadata(), transfer_rank - self.rank)
        check_own_pieces(self._own_side(train, infer), mine, transfer_rank)
        plan = build_plan(train, infer, bucket_bytes)
        rank_plan = plan.for_rank(transfer_rank)
        digest = plan.digest()
        kv.put(pair_name, digest_key(transfer_rank), digest)
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
                return ex.run(int(version))
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
        train, infer, _ = self._world(kv, pair_name, infer_world_size, train_world_size, num_engines)
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


class TrainingAdapter(_AdapterBase):
    """`AwexTrainingAdapter` over an ``nn.Module`` (DTensor/FSDP2/TP or plain parameters) or a
    callable returning canonical name -> tensor (DTensors or local tensors).

    ``metas``: for a callable whose tensors are *local* pieces of larger tensors, their metadata
    (a list, or a callable returning one) in side-local ranks; otherwise derived with
    ``metas_from_dtensors`` (a plain tensor is a full replica on this rank). ``name_map`` turns a
    module's parameter names into canonical (Hugging Face) names, None to skip one. ``rank`` /
    ``world_size`` default to the default process group's. ``optimizer`` adds the "optimizer"
    memory tag. ``backend``: "gloo", "nccl", "native-nccl" or "ipc". CPU colocated mode moves plain
    CPU parameters into one shared-memory segment (rebinding ``param.data``); DTensor CPU
    parameters cannot be moved and must come from ``colocate.share_tensors``.
    """

    role = "training"

    def __init__(self, source: nn.Module | Callable[[], Mapping[str, torch.Tensor]], *, metas: _Metas = None,
                 name_map: Callable[[str], str | None] | None = None, rank: int | None = None,
                 world_size: int | None = None, parallelism: Mapping[str, int] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, admin_api_key: str | None = None,
                 backend: str = "gloo", timeout_s: float = 120.0, bucket_bytes: int = 256 << 20,
                 verify: bool = False, offload_dir: str | None = None, release_hooks: _Hooks = None) -> None:
        d_rank, d_world = _default_rank()
        super().__init__(rank=d_rank if rank is None else rank, admin_api_key=admin_api_key, backend=backend,
                         timeout_s=timeout_s, bucket_bytes=bucket_bytes, verify=verify,
                         offload_dir=offload_dir, release_hooks=release_hooks)
        self.world_size = d_world if world_size is None else int(world_size)
        self.source, self.name_map, self.optimizer = source, name_map, optimizer
        self._metas, self._parallelism = metas, dict(parallelism) if parallelism else None
        self.shared_segments: list[Any] = []

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        if isinstance(self.source, nn.Module):
            out = []
            for raw, p in self.source.named_parameters():
                name = self.name_map(raw) if self.name_map is not None else raw
                if name is not None:
                    out.append((name, p))
            return out
        return list(self.source().items())

    @property
    def parallelism_strategy(self) -> dict:
        """{"world_size", "tp_size", "pp_size", "dp_size", "ep_size", "rank"}: as given at
        construction, else read from the first DTensor's mesh (dims named like tp/pp/ep; the rest
        is data parallel), else pure data parallelism."""
        if self._parallelism is not None:
            return {"rank": self.rank, **self._parallelism}
        sizes = {"tp": 1, "pp": 1, "ep": 1}
        from torch.distributed.tensor import DTensor

        for _, t in self._named():
            if isinstance(t, DTensor):
                mesh = t.device_mesh
                for i, dim in enumerate(mesh.mesh_dim_names or ()):
                    for k in sizes:
                        if k in dim.lower():
                            sizes[k] = mesh.size(i)
                break
        dp = max(1, self.world_size // (sizes["tp"] * sizes["pp"] * sizes["ep"]))
        return {"world_size": self.world_size, "tp_size": sizes["tp"], "pp_size": sizes["pp"], "dp_size": dp,
                "ep_size": sizes["ep"], "rank": self.rank}

    def get_weight_metadata(self) -> list[ParameterMeta]:
        """This rank's pieces (canonical names, training-job rank)."""
        if self._metas is not None:
            return list(self._metas() if callable(self._metas) else self._metas)
        from awex_fast.layouts import metas_from_dtensors

        return metas_from_dtensors(self._named(), self.rank)

    def execute_weight_update(self, version: int) -> dict[str, Any]:
        """Send this rank's buckets for ``version``; returns the executor's stats."""
        with self._lock:
            return self._run_transfer(version)

    def _prepare_colocate(self) -> None:
        named = self._named()
        if not any(_local(t).device.type == "cpu" for _, t in named):
            return
        from torch.distributed.tensor import DTensor

        move = {}
        for name, t in named:
            local = _local(t)
            if local.device.type != "cpu" or find_segment(local) is not None:
                continue
            if isinstance(t, DTensor) or not isinstance(self.source, nn.Module):
                raise MetadataError(f"training rank {self.rank}: CPU tensor {name!r} is not in shared memory "
                                    "and cannot be moved there (a DTensor, or a callable's tensor); allocate "
                                    "it with awex_fast.sync.colocate.share_tensors")
            move[name] = (t, local)
        if move:
            seg, shared = share_tensors({n: loc for n, (_, loc) in move.items()})
            with torch.no_grad():
                for name, (param, _) in move.items():
                    param.data = shared[name]
            self.shared_segments.append(seg)

    def execute_colocate_weight_update(self, version: int) -> dict[str, Any]:
        """Publish handles (in full only when a storage pointer changed), wait for every reader's
        ack. Returns {"republished", "epoch", "seconds"}."""
        with self._lock:
            if self._sender is None:
                raise RuntimeError(f"training rank {self.rank}: call init_colocate_weight_update first")
            t0 = time.perf_counter()
            with self._resident():
                self._prepare_colocate()  # a parameter rebound since the last update moves too
                fresh = self._sender.publish(int(version), self.get_local_shard_parameters())
                self._sender.wait_acks(int(version))
            return {"republished": fresh, "epoch": self._sender.epoch, "seconds": time.perf_counter() - t0}

    def _extra_tags(self) -> list[str]:
        return ["optimizer"] if self.optimizer is not None else []

    def _after_resume(self, tag: str) -> None:
        # Reallocated storage may come back at the old address yet be other memory (a CUDA IPC
        # importer would still read the old allocation): publish the handles anew. Shared
        # segments are restored in place, so their handles stay valid.
        local = self.get_local_shard_parameters().values() if self._sender is not None else ()
        if tag == "weights" and any(find_segment(t) is None for t in local):
            self._sender.forget()

    def _release_tensors(self, tag: str) -> tuple[list[torch.Tensor], bool]:
        if tag == "weights":
            return list(self.get_local_shard_parameters().values()), True
        if tag == "optimizer" and self.optimizer is not None:
            state = self.optimizer.state.values()
            return [_local(v) for st in state for v in st.values() if torch.is_tensor(v)], True
        return super()._release_tensors(tag)


class InferenceAdapter(_AdapterBase):
    """`AwexInferenceAdapter` over a callable returning canonical name -> view of the engine's
    memory (fused layouts: views into qkv_proj / gate_up_proj), plus their metadata in
    engine-local ranks (``metas``: a list or a callable; default: ``metas_from_dtensors`` of the
    views, a plain view being a full replica). ``rank``: this worker's rank inside its engine of
    ``engine_size`` ranks (``tp_size`` defaults to it). ``release_hooks`` maps tags such as
    "kv_cache" to (release, resume) callables of the engine.

    ``version`` is the last version that landed completely; ``failed`` / ``last_error`` flag an
    engine whose last update failed; `require_weights` raises while weights are unusable.
    """

    role = "inference"

    def __init__(self, views: Callable[[], Mapping[str, torch.Tensor]], *, metas: _Metas = None,
                 rank: int = 0, engine_size: int = 1, tp_size: int | None = None,
                 admin_api_key: str | None = None, backend: str = "gloo", timeout_s: float = 120.0,
                 bucket_bytes: int = 256 << 20, verify: bool = False, offload_dir: str | None = None,
                 release_hooks: _Hooks = None) -> None:
        super().__init__(rank=rank, admin_api_key=admin_api_key, backend=backend, timeout_s=timeout_s,
                         bucket_bytes=bucket_bytes, verify=verify, offload_dir=offload_dir,
                         release_hooks=release_hooks)
        if not 0 <= self.rank < engine_size:
            raise ValueError(f"inference rank {rank} outside an engine of {engine_size} ranks")
        self.views, self.engine_size = views, int(engine_size)
        self.tp_size = self.engine_size if tp_size is None else int(tp_size)
        self._metas = metas
        self.version: int | None = None
        self._weights_valid = True

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.views().items())

    @property
    def parallelism_strategy(self) -> dict:
        """{"world_size": engine size, "tp_size", "pp_size": 1, "dp_size": 1, "ep_size": 1, "rank"}."""
        return {"world_size": self.engine_size, "tp_size": self.tp_size, "pp_size": 1, "dp_size": 1,
                "ep_size": 1, "rank": self.rank}

    def get_weight_metadata(self) -> list[ParameterMeta]:
        """This rank's pieces (canonical names, rank inside the engine)."""
        if self._metas is not None:
            return list(self._metas() if callable(self._metas) else self._metas)
        from awex_fast.layouts import metas_from_dtensors

        return metas_from_dtensors(self._named(), self.rank)

    @property
    def weights_ready(self) -> bool:
        """False while weights are released or after a failed update, until an update lands."""
        return self._weights_valid and not self.failed and "weights" not in self._store.released_tags

    def require_weights(self) -> None:
        """Raise `WeightsNotReadyError` (saying why) unless generation may use the weights."""
        if not self.weights_ready:
            if "weights" in self._store.released_tags:
                why = "released"
            elif self.failed:
                why = f"the last update failed: {self.last_error}"
            else:
                why = "released; no update has landed since they were resumed"
            raise WeightsNotReadyError(f"inference rank {self.rank}: weights are not usable ({why})")

    def _landed(self, version: int) -> None:
        self.version, self._weights_valid = int(version), True
        self.failed, self.last_error = False, None

    def _make_room(self) -> None:
        if "weights" in self._store.released_tags:  # an update lands in freshly allocated memory
            self._store.resume("weights")
            self._weights_valid = False

    def execute_weight_update(self, version: int) -> dict[str, Any]:
        """Receive this rank's buckets for ``version``; ``version`` moves only on success."""
        with self._lock:
            self._make_room()
            stats = self._run_transfer(version)
            self._landed(version)
            return stats

    def execute_colocate_weight_update(self, version: int) -> dict[str, Any]:
        """Map the training ranks' handles, copy this rank's boxes, acknowledge."""
        with self._lock:
            if self._receiver is None:
                raise RuntimeError(f"inference rank {self.rank}: call init_colocate_weight_update first")
            self._make_room()
            try:
                stats = self._receiver.run(int(version), self.get_local_shard_parameters())
            except Exception as exc:
                self._fail(exc)
                raise
            self._landed(version)
            return stats

    def _release_tensors(self, tag: str) -> tuple[list[torch.Tensor], bool]:
        if tag == "weights":
            return list(self.get_local_shard_parameters().values()), False
        return super()._release_tensors(tag)

    def _after_resume(self, tag: str) -> None:
        if tag == "weights":
            self._weights_valid = False  # contents were not kept: wait for the next update


__all__ = ["INFER_META_KEY", "MASTER_PORT_KEY", "TRAINING_META_KEY", "AwexInferenceAdapter",
           "AwexTrainingAdapter", "InferenceAdapter", "TrainingAdapter", "WeightsNotReadyError",
           "assemble_world", "check_own_pieces", "decode_side_metas", "digest_key", "encode_side_metas"]
