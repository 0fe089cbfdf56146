"""awex_fast: fast, verified weight synchronization from sharded training to sharded inference.

See DESIGN.md for the vocabulary (transfer ranks, canonical names, shard pieces, plans) and the
public API contract. The native core (awex_fast._C) does planning and copying; this package
validates inputs and moves torch tensors' memory through it.

Names are imported lazily (PEP 562): `import awex_fast` is cheap, and tools that need only the
metadata or the KV store (e.g. `awex-fast kv-server`) never load torch or the native core.
"""

from __future__ import annotations

import importlib
from typing import Any

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
    "simulate": "awex_fast.simulate",
    # execution
    "Executor": "awex_fast.executor",
    "PlanMismatchError": "awex_fast.executor",
    "wire_buckets": "awex_fast.executor",
    "TransferError": "awex_fast.transport",
    "init_transfer_group": "awex_fast.transport",
    # KV store
    "KVStoreServer": "awex_fast.kvstore",
    "KVStoreClient": "awex_fast.kvstore",
    "AsyncKVStoreClient": "awex_fast.kvstore",
    "KVStoreError": "awex_fast.kvstore",
    "KVKeyError": "awex_fast.kvstore",
    "KVAuthError": "awex_fast.kvstore",
    "KVRequestError": "awex_fast.kvstore",
    "KVUnavailableError": "awex_fast.kvstore",
    "KVTimeoutError": "awex_fast.kvstore",
    # adapters, pair controller, colocated mode
    "AwexTrainingAdapter": "awex_fast.adapters",
    "AwexInferenceAdapter": "awex_fast.adapters",
    "TrainingAdapter": "awex_fast.adapters",
    "InferenceAdapter": "awex_fast.adapters",
    "WeightsNotReadyError": "awex_fast.adapters",
    "WeightSyncPair": "awex_fast.pair",
    "HttpWorker": "awex_fast.pair",
    "KVWorker": "awex_fast.pair",
    "PairError": "awex_fast.pair",
    "serve_kv_worker": "awex_fast.pair",
    "worker_app": "awex_fast.worker_routes",
    "worker_routes": "awex_fast.worker_routes",
    "share_tensors": "awex_fast.colocate",
    # native core
    "build_info": "awex_fast._native",
}
_SUBMODULES = {
    "adapters", "bench", "colocate", "copy", "executor", "kvstore", "layouts", "meta", "models", "pair",
    "plan", "transport",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"awex_fast.{name}")
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("awex_fast")
        except PackageNotFoundError:  # a source checkout used in place
            return importlib.import_module("awex_fast._native").build_info()["version"]
    raise AttributeError(f"module 'awex_fast' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


__all__ = sorted(_EXPORTS)
