"""Planning: the Python face of the native planner (`build_plan`, `Plan`, `RankPlan`) and the one
reader of a plan's op rows.

Names resolve lazily (`awex_fast._lazy`): a submodule is imported on first use of one of its names.
"""

from __future__ import annotations

from awex_fast._lazy import lazy_exports

_EXPORTS = {
    "PlanError": "planner",
    "Bucket": "planner",
    "RankPlan": "planner",
    "Plan": "planner",
    "build_plan": "planner",
    "unsupported_casts": "planner",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
