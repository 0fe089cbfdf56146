"""Shard metadata: `ParameterMeta`, `ShardMeta`, `ShardRule`; validation, merging, rank spaces,
and the one JSON (and base64-in-JSON) encoding every process exchanges.

Names resolve lazily (`awex_fast._lazy`): a submodule is imported on first use of one of its names.
"""

from __future__ import annotations

from awex_fast._lazy import lazy_exports

_EXPORTS = {
    "MetadataError": "errors",
    "dtype_name": "dtypes",
    "dtype_itemsize": "dtypes",
    "ShardMeta": "shards",
    "chunk_bounds": "shards",
    "ShardRule": "shards",
    "ParameterMeta": "shards",
    "merge_metas": "merge",
    "validate_metas": "validate",
    "transfer_ranks": "ranks",
    "with_rank_offset": "ranks",
    "metas_from_awex": "ranks",
    "metas_to_json": "codec",
    "metas_from_json": "codec",
    "metas_to_b64": "codec",
    "metas_from_b64": "codec",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
