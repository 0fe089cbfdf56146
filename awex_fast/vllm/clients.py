"""`VLLMWeightSyncClient`s for vLLM engines living in the trainer's own process.

vLLM ships `HTTPVLLMWeightSyncClient` (``vllm serve``) and `RayVLLMWeightSyncClient`; an
offline ``LLM`` or an ``AsyncLLM`` in the same process is driven by these two, with the same
four calls, so the same `AwexFastTrainerWeightTransferEngine` feeds all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["AsyncLLMWeightSyncClient", "LLMWeightSyncClient"]


class LLMWeightSyncClient:
    """Drives an offline ``vllm.LLM`` through ``collective_rpc`` (the worker methods
    ``vllm serve``'s routes call). Safe to call from the trainer engine's helper threads."""

    def __init__(self, llm: Any, timeout_s: float | None = None) -> None:
        self.llm, self.timeout_s = llm, timeout_s
        self.base_url = f"LLM({type(llm).__name__} in pid-local engine)"

    def _rpc(self, method: str, **kwargs: Any) -> None:
        self.llm.collective_rpc(method, timeout=self.timeout_s, kwargs=kwargs or None)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Every worker joins (blocks until the transfer group formed)."""
        self._rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        """Every worker prepares a round."""
        self._rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Every worker receives its boxes of the round."""
        self._rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Every worker finalizes; the engine then reports ``weight_version``."""
        self._rpc("finish_weight_update")
        if weight_version is not None:
            self.llm.llm_engine.set_weight_version(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        """Every worker leaves the transfer group."""
        self._rpc("shutdown_weight_transfer_engine")


class AsyncLLMWeightSyncClient:
    """Drives a ``vllm.v1.engine.async_llm.AsyncLLM`` running on event loop ``loop`` (in another
    thread) from the trainer's synchronous calls."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, timeout_s: float | None = None) -> None:
        self.engine, self.loop, self.timeout_s = engine, loop, timeout_s
        self.base_url = f"AsyncLLM({type(engine).__name__})"

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Every worker joins (blocks until the transfer group formed)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._call(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        """Every worker prepares a round."""
        self._call(self.engine.start_weight_update())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Every worker receives its boxes of the round."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._call(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Every worker finalizes; the engine then reports ``weight_version``."""
        self._call(self.engine.finish_weight_update(weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        """Every worker leaves the transfer group."""
        self._call(self.engine.shutdown_weight_transfer_engine())
