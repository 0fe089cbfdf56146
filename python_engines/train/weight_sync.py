"""Awex uploads of `python_engines.train.engine.FSDPTrainEngine`: its adapter, the controller-less
join, the send half of an update, and uploads into vLLM servers (docs/DESIGN.md, "Who
drives an update").

`TrainWeightSync.adapter` is the engine's ``awex_fast.TrainingAdapter`` over
`named_local_parameters` (training-job rank = global rank; gloo on CPU, nccl on CUDA).
``upload_weights(meta)`` with type ``"awex"`` (alias ``"nccl"``) runs its send half,
``execute_weight_update(version)``, on every training rank at once, while the inference side
runs its receive half. The group it sends over is:

- the one a controller formed, if the adapter already holds one (a `WeightSyncPair` or AReaL's
  gateway called ``init_weight_update_group`` on it, e.g. through ``/awex/*`` routes served over
  the adapter): nothing is published or joined, the upload only sends;
- otherwise the one the engine joins itself, with no controller, on the first awex upload (and
  again when the pair fields of ``meta`` change, or after a failed update), by the steps of
  ``awex_fast.sync.join``: training rank ``t`` puts its metas (``awex_fast.meta.metas_to_b64``)
  under the pair's KV key ``training_params_meta_rank{t}``; once every rank did, training rank 0
  merges them, publishes ``training_params_meta`` (one group, the job's world size, and the
  adapter's ``bucket_bytes`` so that both sides plan alike) and deletes the per-rank keys. Every
  rank then waits for ``infer_params_meta``, which the inference side publishes (one group per
  engine, in engine order, with the engine sizes): ``num_engines`` is the number of published
  engines, ``infer_world_size`` the sum of their sizes, and the training world size is this
  job's. Transfer rank = ``infer_world_size + global rank``. Every rank then calls
  ``init_weight_update_group`` with ``meta.pair_name``, ``meta.kv_store_url`` and
  ``meta.nccl_master_address`` / ``nccl_master_port`` (0: inference transfer rank 0 binds a
  port and publishes ``transfer_master_port``). The inference side mirrors the rule: it
  publishes ``infer_params_meta`` (after deleting a stale ``transfer_master_port``), reads the
  training world size from ``training_params_meta``, and joins concurrently. There is no
  separate warm-up: the update right after the join is the first exchange.

Failures are collective: after each step of a join and after each update, one all-reduce tells
every training rank which ranks failed, so no rank waits in a collective its peers left. A
failed join raises `WeightSyncNotWiredError` on every rank (naming the step, the pair, the KV
store and the failing ranks, chained to this rank's own error). A failed update re-raises a
failing rank's own ``TransferError`` (the other ranks raise a ``TransferError`` naming the
failed ranks) and, for a group this engine joined, makes the next awex upload tear it down and
join again; a group a controller formed is left to that controller to re-form. Without a
controller a re-join needs the inference side to re-publish and re-join too, on a fresh
``nccl_master_port`` (with port 0, a stale ``transfer_master_port`` must be deleted before
either side re-joins), and the KV namespace of a pair is expected to be fresh for each job (a
leftover ``infer_params_meta`` would be read as current).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from awex_fast.meta import merge_metas, metas_from_b64, metas_to_b64
from awex_fast.net import KVStoreClient
from awex_fast.sync import JoinError, World, gather_rank_metas, publish_side, run_step, wait_side
from python_engines.api import WeightUpdateMeta

if TYPE_CHECKING:
    from awex_fast.sync import TrainingAdapter

__all__ = ["TRAINING_RANK_META_KEY", "TrainWeightSync", "WeightSyncNotWiredError"]

#: KV key (per pair) where training rank ``rank`` leaves its metas for rank 0 to merge during a
#: controller-less join (module docstring); deleted once ``training_params_meta`` is published.
TRAINING_RANK_META_KEY = "training_params_meta_rank{rank}"


class WeightSyncNotWiredError(JoinError):
    """An awex upload could not wire the engine into a weight-sync group: no KV store URL, or a
    step of the controller-less join (publishing, merging, waiting for the inference side's
    metadata, joining the transfer group) failed on some training rank. Raised on every rank;
    ``step`` names the step, ``failed_ranks`` the training ranks where it failed (``rank`` the
    first of them), and ``__cause__`` is this rank's own error when it was one of them."""

    def __init__(self, message: str, *, step: str, failed_ranks: list[int], pair: str | None = None,
                 kv_url: str | None = None) -> None:
        super().__init__(message, step=step, pair=pair, kv_url=kv_url,
                         rank=failed_ranks[0] if failed_ranks else None)
        self.failed_ranks = list(failed_ranks)


def _fields(meta: WeightUpdateMeta) -> tuple[str, str, str, int]:
    """The pair fields of ``meta``: a change of any of them means another group."""
    return meta.pair_name, str(meta.kv_store_url), meta.nccl_master_address, int(meta.nccl_master_port)


class TrainWeightSync:
    """The awex side of one `FSDPTrainEngine` (module docstring); every method is collective
    over the engine's ranks. ``engine`` must be initialized before the first call."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._adapter: TrainingAdapter | None = None
        self._joined: tuple[str, str, str, int] | None = None  # pair fields of a group joined here
        self._rejoin = False  # the last update over a group joined here failed
        #: The adapter's stats of the last successful awex upload on this rank (bytes, seconds).
        self.last_update: dict[str, Any] | None = None
        self.vllm_urls: list[str] = []  # vLLM servers awex uploads go to (connect_engine)
        self._vllm_timeout_s = 300.0  # connect_engine(timeout_s=...)
        self._vllm: Any = None  # awex_fast.vllm's trainer engine, built at the first upload

    def adapter(self) -> TrainingAdapter:
        """The engine's adapter, built on first use and kept (see the engine's
        ``weight_sync_adapter``)."""
        if self._adapter is None:
            from awex_fast.sync import TrainingAdapter

            engine = self.engine
            engine.model  # noqa: B018 (raises before initialize)
            world = dist.get_world_size()
            self._adapter = TrainingAdapter(
                engine.named_local_parameters,
                rank=dist.get_rank(),
                world_size=world,
                parallelism={"world_size": world, "tp_size": engine.config.tp_size, "pp_size": 1,
                             "dp_size": engine.data_parallel_world_size, "ep_size": 1},
                optimizer=engine.optimizer,
                backend="nccl" if engine.device.type == "cuda" else "gloo",
            )
        return self._adapter

    def close(self) -> None:
        """Leave any group; drop the adapter and the vLLM trainer engine."""
        if self._adapter is not None:
            self._adapter.teardown_weight_update_group()
            self._adapter, self._joined = None, None
        if self._vllm is not None:
            self._vllm.shutdown()
            self._vllm = None

    # ------------------------------------------------------------------ the join

    def _ranks_where(self, flag: bool) -> list[int]:
        """One all-reduce over the engine's ranks: the training ranks whose ``flag`` is true."""
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=self.engine.device)
        flags[dist.get_rank()] = int(flag)
        dist.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def _step(self, step: str, meta: WeightUpdateMeta, fn: Callable[[], Any]) -> Any:
        """Run one join step (`awex_fast.sync.run_step`) on this rank, then agree with every
        rank; `WeightSyncNotWiredError` on every rank if any failed."""
        pair, url, rank = meta.pair_name, meta.kv_store_url, dist.get_rank()
        error: JoinError | None = None
        out = None
        try:
            out = run_step(step, fn, pair=pair, kv_url=url, rank=rank)
        except JoinError as exc:  # every rank must hear of it before anyone raises
            error = exc
        failed = self._ranks_where(error is not None)
        if failed:
            own = f": {error}" if error is not None else ""
            raise WeightSyncNotWiredError(
                f"training rank {rank}: awex upload to pair {pair!r} at {url}: step {step!r} failed on "
                f"training ranks {failed}{own}",
                step=step, failed_ranks=failed, pair=pair, kv_url=url,
            ) from error
        return out

    def _merge(self, kv: KVStoreClient, meta: WeightUpdateMeta, adapter: TrainingAdapter) -> None:
        """Rank 0: merge every rank's metas into ``training_params_meta``, drop the per-rank keys."""
        pair, world = meta.pair_name, dist.get_world_size()
        keys = [TRAINING_RANK_META_KEY.format(rank=r) for r in range(world)]
        groups = gather_rank_metas(kv, pair, keys, adapter.timeout_s,
                                   step="merge and publish training_params_meta", who="training rank",
                                   decode=lambda v, what: metas_from_b64(v, what=what))
        publish_side(kv, pair, "training", [merge_metas(groups)], [world], bucket_bytes=adapter.bucket_bytes)
        for k in keys:
            kv.delete(pair, k)

    def _join(self, adapter: TrainingAdapter, meta: WeightUpdateMeta) -> dict[str, Any]:
        """The controller-less join (module docstring); collective. Returns the adapter's init
        result."""
        pair, url = meta.pair_name, meta.kv_store_url
        rank, world = dist.get_rank(), dist.get_world_size()
        if not url:
            raise WeightSyncNotWiredError(
                f"training rank {rank}: WeightUpdateMeta.kv_store_url is required for an awex upload when "
                "no controller formed the weight-sync group (see WeightUpdateMeta.from_awex)",
                step="kv_store_url", failed_ranks=list(range(world)), pair=pair,
            )
        clients: list[KVStoreClient] = []

        def publish() -> None:
            clients.append(KVStoreClient(url, adapter.admin_api_key or ""))
            blob = metas_to_b64(adapter.get_weight_metadata())
            clients[0].put(pair, TRAINING_RANK_META_KEY.format(rank=rank), blob)

        try:
            self._step("publish training metadata", meta, publish)
            self._step("merge and publish training_params_meta", meta,
                       lambda: self._merge(clients[0], meta, adapter) if rank == 0 else None)
            sizes = self._step("wait for infer_params_meta", meta,
                               lambda: wait_side(clients[0], pair, "inference", adapter.timeout_s)[0])
        finally:
            for kv in clients:
                kv.close()
        tw = World(tuple(sizes), world)
        args = tw.init_args(pair, url, meta.nccl_master_address, int(meta.nccl_master_port),
                            tw.training_rank(rank))
        return self._step("init_weight_update_group", meta, lambda: adapter.init_weight_update_group(**args))

    # ------------------------------------------------------------------ uploads

    def upload(self, meta: WeightUpdateMeta) -> None:
        """The send half of an awex update of ``meta.version`` (default: the engine's version):
        into the connected vLLM servers (`connect_engine`), else through `adapter`."""
        if self.vllm_urls:
            self._upload_vllm(meta)
        else:
            self._upload_awex(meta)

    def _version(self, meta: WeightUpdateMeta) -> int:
        return meta.version if meta.version is not None else self.engine.get_version()

    def _must_join(self, adapter: TrainingAdapter, meta: WeightUpdateMeta) -> bool:
        """Whether this upload joins (no controller's group, new pair fields, or a failed update);
        every rank must agree."""
        by_controller = adapter.transfer_rank is not None and self._joined is None
        join = not by_controller and (self._joined != _fields(meta) or self._rejoin)
        joining = self._ranks_where(join)
        if 0 < len(joining) < dist.get_world_size():
            raise WeightSyncNotWiredError(
                f"training rank {dist.get_rank()}: training ranks {joining} would join a weight-sync group "
                "while the others send over the one they hold (a controller formed it on some ranks only?)",
                step="agree on the group", failed_ranks=joining, pair=meta.pair_name,
                kv_url=meta.kv_store_url,
            )
        return join

    def _upload_awex(self, meta: WeightUpdateMeta) -> None:
        from awex_fast.transport import TransferError

        adapter = self.adapter()
        if meta.admin_api_key is not None:
            adapter.admin_api_key = meta.admin_api_key
        if self._must_join(adapter, meta):
            self._joined = None
            adapter.teardown_weight_update_group()
            try:
                self._join(adapter, meta)
            except WeightSyncNotWiredError:
                adapter.teardown_weight_update_group()  # ranks whose init succeeded leave too
                raise
            self._joined, self._rejoin = _fields(meta), False
        version = self._version(meta)
        error: Exception | None = None
        stats = None
        try:
            stats = adapter.execute_weight_update(version)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it before anyone raises
            error = exc
        failed = self._ranks_where(error is not None)
        if failed:
            self._rejoin = self._joined is not None
            if error is not None:
                raise error
            raise TransferError(
                f"training rank {dist.get_rank()}: the awex update to version {version} failed on training "
                f"ranks {failed}; the group must be re-formed before the next update",
                version=version,
            )
        self.last_update = stats

    def connect_engine(self, engine: Any, *, timeout_s: float = 300.0) -> None:
        """See ``FSDPTrainEngine.connect_engine``."""
        urls = [engine] if isinstance(engine, str) else getattr(engine, "addresses", engine)
        urls = [u if u.startswith("http") else f"http://{u}" for u in urls]
        if not urls:
            raise ValueError("connect_engine: no vLLM server addresses")
        if self._vllm is not None and (urls != self.vllm_urls or timeout_s != self._vllm_timeout_s):
            self._vllm.shutdown()
            self._vllm = None
        self.vllm_urls, self._vllm_timeout_s = urls, float(timeout_s)

    def _upload_vllm(self, meta: WeightUpdateMeta) -> None:
        """The awex upload into the connected vLLM servers (`connect_engine`): one round of
        ``awex_fast.vllm`` to ``meta.version`` (default: the engine's version); every server
        reports that version once it landed. Raises ``awex_fast.vllm.SendError`` on every rank if
        it failed."""
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

        from awex_fast.vllm import AwexFastTrainerInitInfo, ShardedSource

        if self._vllm is None:
            info = AwexFastTrainerInitInfo(
                rank=dist.get_rank(), world_size=dist.get_world_size(),
                transport="nccl" if self.engine.device.type == "cuda" else "gloo",
                kv_store_url=meta.kv_store_url, admin_api_key=meta.admin_api_key,
                pair=meta.pair_name if meta.kv_store_url else None, timeout_s=self._vllm_timeout_s)
            # only rank 0 talks to vLLM; the others hold no client
            clients = [HTTPVLLMWeightSyncClient(u) for u in self.vllm_urls] if dist.get_rank() == 0 else None
            self._vllm = WeightTransferTrainerFactory.trainer_init(
                info, client=clients, source=ShardedSource(self.engine.named_local_parameters))
        self._vllm.send_weights(version=self._version(meta))
        self.last_update = dict(self._vllm.last_round)
