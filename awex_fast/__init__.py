"""awex_fast: fast, verified weight synchronization from sharded training to sharded inference.

See docs/DESIGN.md for the layers, the vocabulary (transfer ranks, canonical names, shard pieces,
plans) and the failure contract; the public API is this package's ``_EXPORTS``. The native core
(awex_fast._C) does planning and copying; this package validates inputs and moves torch tensors'
memory through it.

Names are imported lazily (PEP 562): `import awex_fast` is cheap, and tools that need only the
metadata or the KV store (e.g. `awex-fast kv-server`) never load torch or the native core.
"""

from __future__ import annotations

import importlib
from typing import Any

from awex_fast._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # metadata
    "MetadataError": "awex_fast.meta",
    "ParameterMeta": "awex_fast.meta",
    "ShardMeta": "awex_fast.meta",
    "ShardRule": "awex_fast.meta",
    "chunk_bounds": "awex_fast.meta",
    "dtype_itemsize": "awex_fast.meta",
    "dtype_name": "awex_fast.meta",
    "merge_metas": "awex_fast.meta",
    "metas_from_awex": "awex_fast.meta",
    "metas_from_json": "awex_fast.meta",
    "metas_to_json": "awex_fast.meta",
    "metas_from_b64": "awex_fast.meta",
    "metas_to_b64": "awex_fast.meta",
    "transfer_ranks": "awex_fast.meta",
    "validate_metas": "awex_fast.meta",
    "with_rank_offset": "awex_fast.meta",
    # layouts
    "metas_from_dtensors": "awex_fast.layouts",
    "FusedLayout": "awex_fast.layouts",
    "DecoderConfig": "awex_fast.layouts",
    "pad_vocab_size": "awex_fast.layouts",
    "ParallelLayout": "awex_fast.layouts",
    "megatron_metas": "awex_fast.layouts",
    # planning
    "Bucket": "awex_fast.plan",
    "Plan": "awex_fast.plan",
    "PlanError": "awex_fast.plan",
    "RankPlan": "awex_fast.plan",
    "build_plan": "awex_fast.plan",
    "simulate": "awex_fast.transfer",
    # execution
    "Executor": "awex_fast.transfer",
    "PlanMismatchError": "awex_fast.transfer",
    "wire_buckets": "awex_fast.transfer",
    "TransferError": "awex_fast.transport",
    "init_transfer_group": "awex_fast.transport",
    # KV store
    "KVStoreServer": "awex_fast.net",
    "KVStoreClient": "awex_fast.net",
    "AsyncKVStoreClient": "awex_fast.net",
    "KVStoreError": "awex_fast.net",
    "KVKeyError": "awex_fast.net",
    "KVAuthError": "awex_fast.net",
    "KVRequestError": "awex_fast.net",
    "KVUnavailableError": "awex_fast.net",
    "KVTimeoutError": "awex_fast.net",
    # adapters, pair controller, colocated mode
    "AwexTrainingAdapter": "awex_fast.sync",
    "AwexInferenceAdapter": "awex_fast.sync",
    "TrainingAdapter": "awex_fast.sync",
    "InferenceAdapter": "awex_fast.sync",
    "WeightsNotReadyError": "awex_fast.sync",
    "WeightSyncPair": "awex_fast.sync",
    "HttpWorker": "awex_fast.sync",
    "KVWorker": "awex_fast.sync",
    "PairError": "awex_fast.sync",
    "serve_kv_worker": "awex_fast.sync",
    "worker_app": "awex_fast.sync",
    "worker_routes": "awex_fast.sync",
    "share_tensors": "awex_fast.sync",
    # native core
    "build_info": "awex_fast._native",
}
_base_getattr, _base_dir = lazy_exports(__name__, _EXPORTS, globals())


def __getattr__(name: str) -> Any:
    """Public names and subpackages on first use; ``copy`` is `awex_fast.transfer.boxcopy`
    (``af.copy.pack`` / ``af.copy.unpack``), ``__version__`` the installed version."""
    if name == "copy":
        value = importlib.import_module("awex_fast.transfer.boxcopy")
        globals()[name] = value
        return value
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("awex_fast")
        except PackageNotFoundError:  # a source checkout used in place
            return importlib.import_module("awex_fast._native").build_info()["version"]
    return _base_getattr(name)


def __dir__() -> list[str]:
    return sorted([*_base_dir(), "copy", "__version__"])


__all__ = sorted(_EXPORTS)
