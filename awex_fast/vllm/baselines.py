"""vLLM's own broadcast algorithm on gloo, as weight-transfer backend ``"awex_fast_broadcast"``.

The peer that `awex-fast bench --engine vllm` measures awex_fast against on a machine without
NCCL. It reproduces vLLM's ``nccl`` backend (``vllm/distributed/weight_transfer/nccl_engine.py``
with ``packed_tensor.py``), changing only the transport:

* one group of trainer rank 0 (group rank 0) and every vLLM worker (group ranks 1..W, vLLM's
  ``rank_offset`` convention), here a ``ProcessGroupGloo`` (`awex_fast.transport`'s gloo group);
* every trainer rank iterates its `WeightSource` (FSDP2: ``DTensor.full_tensor()``, a collective),
  rank 0 casts each full tensor to the inference dtype and packs tensors into uint8 buckets of
  ``buffer_size_bytes`` (vLLM's `pack_tensors`, cut once a bucket exceeds the size), and
  broadcasts each bucket to every worker;
* every worker receives each bucket, unpacks it (vLLM's `unpack_tensor`) and hands it to
  ``model.load_weights`` inside vLLM's layerwise reload (``start_weight_update`` initialises it,
  ``finish_weight_update`` finalizes it: CPU repacking, quantization).

Every worker receives every byte of every tensor, whatever its TP shard: that is the algorithm.
CPU gloo broadcasts are synchronous, so vLLM's CUDA-stream double buffering has no counterpart.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    pack_tensors,
    unpack_tensor,
)

from awex_fast.net import free_port
from awex_fast.transport.torch_dist import TorchTransferGroup

__all__ = [
    "BACKEND_NAME",
    "BroadcastTrainerInitInfo",
    "BroadcastTrainerWeightTransferEngine",
    "BroadcastUpdateInfo",
    "BroadcastWeightTransferEngine",
    "BroadcastWorkerInitInfo",
    "register",
]

BACKEND_NAME = "awex_fast_broadcast"
_GROUP_NAME = "awex_fast_broadcast"


@dataclass
class BroadcastWorkerInitInfo(WeightTransferInitInfo):
    """What trainer rank 0 sends every worker at ``/init_weight_transfer_engine``."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    timeout_s: float = 300.0


@dataclass
class BroadcastUpdateInfo(WeightTransferUpdateInfo):
    """Per-round parameter metadata, in the order rank 0 packs them (as vLLM's nccl backend)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names/dtype_names/shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


def _broadcast(group: TorchTransferGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group._pg.broadcast([tensor], opts).wait()


def _consume(group: TorchTransferGroup, metas: Iterator[tuple[str, list[int], torch.dtype]],
             buffer_size_bytes: int, load: Any, device: torch.device) -> None:
    """vLLM's `packed_nccl_broadcast_consumer` on a synchronous group: cut the metadata into the
    producer's buckets (a bucket ends once it exceeds ``buffer_size_bytes``), receive each, unpack
    it and hand it to ``load``."""
    bucket: list[tuple[str, list[int], torch.dtype, int]] = []
    size = 0

    def flush() -> None:
        packed = torch.empty(size, dtype=torch.uint8, device=device)
        _broadcast(group, packed)
        names, shapes, dtypes, sizes = zip(*bucket, strict=True)
        load(unpack_tensor(packed, list(names), list(shapes), list(dtypes), list(sizes)))

    for name, shape, dtype in metas:
        nbytes = math.prod(shape) * dtype.itemsize
        bucket.append((name, shape, dtype, nbytes))
        size += nbytes
        if size > buffer_size_bytes:
            flush()
            bucket, size = [], 0
    if bucket:
        flush()


class BroadcastWeightTransferEngine(WeightTransferEngine[BroadcastWorkerInitInfo, BroadcastUpdateInfo]):
    """Worker engine of backend ``"awex_fast_broadcast"`` (module docstring)."""

    init_info_cls = BroadcastWorkerInitInfo
    update_info_cls = BroadcastUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: TorchTransferGroup | None = None
        self.buffer_size_bytes = DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.last_timings: dict[str, float] = {}

    def init_transfer_engine(self, init_info: BroadcastWorkerInitInfo) -> None:
        """Join the gloo group as ``rank_offset`` + this worker's global rank."""
        self.shutdown()
        pc = self.parallel_config
        worker = int(pc.data_parallel_index) * int(pc.world_size) + int(pc.rank)
        self.buffer_size_bytes = int(init_info.buffer_size_bytes)
        self.group = TorchTransferGroup("gloo", worker + int(init_info.rank_offset),
                                        int(init_info.world_size), init_info.master_address,
                                        int(init_info.master_port), float(init_info.timeout_s),
                                        group_name=_GROUP_NAME)

    def start_weight_update(self) -> None:
        """Begin vLLM's layerwise reload."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
        """Receive every packed bucket and load it through ``model.load_weights``."""
        if self.group is None:
            raise RuntimeError("awex_fast_broadcast: not initialised; call init_weight_transfer_engine")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        info = update_info
        metas = ((n, list(s), getattr(torch, d))
                 for n, d, s in zip(info.names, info.dtype_names, info.shapes, strict=True))
        t0 = time.perf_counter()
        with disable_mtp_completeness_check():
            _consume(self.group, metas, self.buffer_size_bytes, self.model.load_weights, self.device)
        self.last_timings = {"receive_load_s": time.perf_counter() - t0}

    def finish_weight_update(self) -> None:
        """Finalize vLLM's layerwise reload (repacking, quantization)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        self.last_timings["finalize_s"] = time.perf_counter() - t0

    def shutdown(self) -> None:
        """Leave the group."""
        if self.group is not None:
            self.group.close()
        self.group = None


@dataclass
class BroadcastTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of ``"awex_fast_broadcast"``. ``num_workers``: the vLLM workers
    (TP x DP of the server). ``dtype``: the inference dtype rank 0 casts each full tensor to
    (None: send the training dtype). ``master_port`` 0 picks a free port."""

    backend: ClassVar[str] = BACKEND_NAME

    num_workers: int = 1
    master_address: str = "127.0.0.1"
    master_port: int = 0
    dtype: str | None = "bfloat16"
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    timeout_s: float = 300.0


class BroadcastTrainerWeightTransferEngine(TrainerWeightTransferEngine[BroadcastTrainerInitInfo]):
    """Trainer engine of ``"awex_fast_broadcast"``: rank 0 gathers, packs, broadcasts; the other
    ranks only join the gather (vLLM's `NCCLTrainerWeightTransferEngine`)."""

    init_info_cls = BroadcastTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True,
                 init_info: BroadcastTrainerInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = init_info or BroadcastTrainerInitInfo(rank=0)
        self.group: TorchTransferGroup | None = None
        self.dtype = getattr(torch, self.info.dtype) if self.info.dtype else None
        self.last_round: dict[str, float] = {}

    @classmethod
    def trainer_init(cls, init_info: BroadcastTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:
        """Build the engine; rank 0 forms the group with every worker (workers join on a side
        thread through ``init_weight_transfer_engine``)."""
        if source is None:
            raise ValueError("awex_fast_broadcast needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if not engine.is_sender:
            return engine
        info = init_info
        port = int(info.master_port) or free_port(info.master_address)
        world = 1 + int(info.num_workers)
        worker_info = BroadcastWorkerInitInfo(master_address=info.master_address, master_port=port,
                                              world_size=world, buffer_size_bytes=int(info.buffer_size_bytes),
                                              timeout_s=float(info.timeout_s))
        with ThreadPoolExecutor(max_workers=1) as pool:
            fut = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = TorchTransferGroup("gloo", 0, world, info.master_address, port,
                                              float(info.timeout_s), group_name=_GROUP_NAME)
            fut.result(timeout=info.timeout_s)
        return engine

    def _cast(self, item: tuple[str, torch.Tensor]) -> torch.Tensor:
        t = item[1]
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def send_weights(self) -> None:
        """One round: rank 0 drives start / update (concurrently with its broadcasts) / finish;
        ``last_round`` holds ``start_s``, ``update_s`` and ``finish_s`` on rank 0."""
        assert self.source is not None
        source = self.source
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:  # join the trainer-side gathers
                pass
            return
        assert self.group is not None, "trainer_init() must run first"

        def wire_dtype(d: torch.dtype) -> torch.dtype:
            return self.dtype if self.dtype is not None and d.is_floating_point else d

        dtype_names = [str(wire_dtype(m.dtype)).removeprefix("torch.") for m in meta]
        update = BroadcastUpdateInfo(names=[m.name for m in meta], dtype_names=dtype_names,
                                     shapes=[list(m.shape) for m in meta])
        t0 = time.perf_counter()
        self.client.start_weight_update()
        t1 = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            fut = pool.submit(self.client.update_weights, asdict(update))
            pairs = iter(source)
            while True:
                chunk = pack_tensors(pairs, self._cast, int(self.info.buffer_size_bytes))
                if chunk is None:
                    break
                _broadcast(self.group, chunk.packed_tensor)
                del chunk
            fut.result(timeout=self.info.timeout_s)
        finally:
            pool.shutdown(wait=False)
        t2 = time.perf_counter()
        self.client.finish_weight_update()
        t3 = time.perf_counter()
        self.last_round = {"start_s": t1 - t0, "update_s": t2 - t1, "finish_s": t3 - t2, "seconds": t3 - t0}

    def shutdown(self) -> None:
        """Leave the group and shut the workers' engines down."""
        if self.group is not None:
            self.group.close()
            self.group = None
            stop = getattr(self.client, "shutdown_weight_transfer_engine", None)
            if stop is not None:
                with contextlib.suppress(Exception):  # a dead server has nothing to shut down
                    stop()


def register() -> None:
    """Register ``"awex_fast_broadcast"`` in vLLM's worker and trainer factories (idempotent)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, BroadcastWeightTransferEngine)
    if BACKEND_NAME not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND_NAME, BroadcastTrainerWeightTransferEngine)


class BenchWorkerExtension:
    """vLLM worker extension (``--worker-extension-cls
    awex_fast.vllm.baselines.BenchWorkerExtension``) that lets one server hold several
    weight-transfer engines and switch between them through ``/collective_rpc``, so that
    `awex-fast bench --engine vllm` times every route on the same server. Engines are kept, so a
    switch back finds its transfer group still joined."""

    def awex_fast_use_backend(self, name: str) -> str:
        """Make backend ``name``'s engine the worker's weight-transfer engine; returns the name
        of the engine that was active. ``BACKEND#TAG`` is a second engine of ``BACKEND`` (one per
        route, e.g. ``awex_fast#receiver``: awex_fast joined with another trainer engine)."""
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory

        worker: Any = self
        engines: dict[str, Any] = worker.__dict__.setdefault("_awex_fast_engines", {})
        current = worker.weight_transfer_engine
        previous = str(getattr(worker.vllm_config.weight_transfer_config, "backend", ""))
        if current is not None:
            previous = next((k for k, v in engines.items() if v is current), previous)
            engines[previous] = current
        if name not in engines:
            engines[name] = WeightTransferEngineFactory.create_engine(
                WeightTransferConfig(backend=name.partition("#")[0]), worker.vllm_config, worker.device,
                worker.model_runner.get_model())
        worker.weight_transfer_engine = engines[name]
        return previous

    def awex_fast_last_timings(self) -> dict[str, float]:
        """The active engine's ``last_timings`` (seconds per phase of its last round)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return {k: float(v) for k, v in dict(getattr(engine, "last_timings", {}) or {}).items()}
