"""Draft-model weight sessions (vLLM's ``start_draft_weight_update``) refused in the engine
client, before any worker sees the call.

awex_fast does not sync speculative draft models (MTP / EAGLE heads) yet. Left to vLLM, every
worker raises (its worker refuses an engine without draft support), and vLLM 0.32's multiprocess
executor raises on the first failed reply while the other workers' replies stay queued: every
later RPC of that server (``/weight_checker``, the next round) then reads a stale failure, so one
refused call wedges the server. The refusal therefore happens where the call enters vLLM — the
``AsyncLLM`` behind ``vllm serve`` and in-process async engines, and the offline ``LLM`` — with an
error that says what to do, and the workers never receive it.

`install` patches those entry points in the processes that have them (the API server and the
trainer-side engines; never the workers, which import neither) and only for servers whose
weight-transfer backend is awex_fast.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

__all__ = ["DRAFT_REFUSAL", "DraftWeightUpdateError", "install"]

DRAFT_REFUSAL = ("awex_fast does not update speculative draft model weights; the draft keeps its "
                 "weights. Sync the target model with start_weight_update / update_weights / "
                 "finish_weight_update, or serve the draft with another weight-transfer backend")
_MARK = "_awex_fast_draft_guard"


class DraftWeightUpdateError(NotImplementedError):
    """A draft-model weight session was asked of a server whose backend is awex_fast."""


def _is_awex_fast(vllm_config: Any) -> bool:
    config = getattr(vllm_config, "weight_transfer_config", None)
    return getattr(config, "backend", None) == "awex_fast"


def _guard_async(cls: type) -> None:
    original = cls.start_draft_weight_update
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    async def start_draft_weight_update(self: Any) -> None:
        if _is_awex_fast(getattr(self, "vllm_config", None)):
            raise DraftWeightUpdateError(DRAFT_REFUSAL)
        await original(self)

    setattr(start_draft_weight_update, _MARK, True)
    cls.start_draft_weight_update = start_draft_weight_update


def _guard_offline(cls: type) -> None:
    original = cls.start_draft_weight_update
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def start_draft_weight_update(self: Any) -> None:
        if _is_awex_fast(getattr(getattr(self, "llm_engine", None), "vllm_config", None)):
            raise DraftWeightUpdateError(DRAFT_REFUSAL)
        original(self)

    setattr(start_draft_weight_update, _MARK, True)
    cls.start_draft_weight_update = start_draft_weight_update


def install() -> None:
    """Guard the draft entry points this process has (idempotent; imports nothing new in a
    vLLM worker). Run by the plugin entry point (`awex_fast.vllm.register`)."""
    serving = "vllm.entrypoints.launchers.api_server.entry" in sys.modules
    if serving or "vllm.v1.engine.async_llm" in sys.modules:
        from vllm.v1.engine.async_llm import AsyncLLM

        _guard_async(AsyncLLM)
    if "vllm.entrypoints.rl.offline" in sys.modules:
        from vllm.entrypoints.rl.offline import RLOfflineMixin

        _guard_offline(RLOfflineMixin)
