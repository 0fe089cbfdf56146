"""`awex-fast bench`: the sync benchmark (`run`), its per-rank worker, the vLLM benchmark, and the
Awex 0.9 baseline where Awex is installed.

Names resolve lazily (`awex_fast._lazy`): a submodule is imported on first use of one of its names.
"""

from __future__ import annotations

from awex_fast._lazy import lazy_exports

_EXPORTS = {
    "bench_main": "run",
    "bench_vllm_main": "vllm",
    "awex_available": "awex_baseline",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
