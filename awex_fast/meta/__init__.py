"""Shard metadata: `ParameterMeta`, `ShardMeta`, `ShardRule`; validation, merging, rank spaces,
and the one JSON (and base64-in-JSON) encoding every process exchanges.

Names resolve lazily (`awex_fast._lazy`): a submodule is imported on first use of one of its names.
"""

from __future__ import annotations

from awex_fast._lazy import lazy_exports

_EXPORTS = {
    "MetadataError": "core",
    "dtype_name": "core",
    "dtype_itemsize": "core",
    "ShardMeta": "core",
    "chunk_bounds": "core",
    "ShardRule": "core",
    "ParameterMeta": "core",
    "merge_metas": "core",
    "validate_metas": "core",
    "transfer_ranks": "core",
    "with_rank_offset": "core",
    "metas_from_awex": "core",
    "metas_to_json": "codec",
    "metas_from_json": "codec",
    "metas_to_b64": "codec",
    "metas_from_b64": "codec",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
