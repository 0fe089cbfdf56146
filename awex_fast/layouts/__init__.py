"""Metadata builders: which box of which canonical tensor each rank holds.

* `metas_from_dtensors` (`awex_fast.layouts.dtensor`): exact pieces of DTensors (FSDP2, TP,
  2-D FSDP2 x TP with ``_StridedShard``, HSDP, uneven chunks); plain tensors are replicas.
* `ParallelLayout`, `megatron_metas` (`awex_fast.layouts.megatron`): Megatron-style TP / PP /
  CP / DP / EP layouts as compact `ShardRule` grids for a whole training side.
* `FusedLayout`, `DecoderConfig` (`awex_fast.layouts.fused`): vLLM / SGLang fused per-TP-rank
  tensors as canonical views, their metas, shapes and an allocator.

Names resolve lazily (`awex_fast._lazy`): a submodule is imported on first use of one of its names, so
``from awex_fast.layouts import megatron_metas`` does not load the DTensor or fused modules.
"""

from __future__ import annotations

from awex_fast._lazy import lazy_exports

_EXPORTS = {
    "metas_from_dtensors": "dtensor",
    "CanonicalSlot": "fused",
    "DecoderConfig": "fused",
    "FusedLayout": "fused",
    "VOCAB_PADDING": "fused",
    "pad_vocab_size": "fused",
    "MEGATRON_ORDER": "megatron",
    "ParallelLayout": "megatron",
    "megatron_metas": "megatron",
    "megatron_style": "megatron",
    "ModelSpec": "models",
    "TensorSpec": "models",
    "model_spec": "models",
    "model_names": "models",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
