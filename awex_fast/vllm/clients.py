"""`VLLMWeightSyncClient`s for vLLM engines living in the trainer's own process, and the hold on
generation that keeps an engine with mixed weights from serving.

vLLM ships `HTTPVLLMWeightSyncClient` (``vllm serve``) and `RayVLLMWeightSyncClient`; an
offline ``LLM`` or an ``AsyncLLM`` in the same process is driven by these two, with the same
four calls, so the same `AwexFastTrainerWeightTransferEngine` feeds all of them.

`GenerationHold`: a round that fails in ``inplace`` mode leaves some live parameters new and
some old. The trainer then pauses that engine's generation (vLLM's ``/pause?mode=keep`` on a
server, ``AsyncLLM.pause_generation(mode="keep")`` in process: queued and running requests
freeze, none is lost) and resumes it after the next round that lands there. An offline ``LLM``
has no pause: generation is the caller's own call there, and the round's error says not to
generate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import Coroutine
from typing import Any

__all__ = ["MIXED_WEIGHTS", "AsyncLLMWeightSyncClient", "GenerationHold", "LLMWeightSyncClient",
           "current_label"]

logger = logging.getLogger(__name__)

# What a worker's round error says when its live parameters were left mixed (`awex_fast.vllm.worker`).
MIXED_WEIGHTS = "the served weights are MIXED (in-place mode)"


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


def _server_post(base_url: str, path: str, timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(f"{base_url.rstrip('/')}{path}", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read() or b"{}")


def _set_paused(client: Any, paused: bool, timeout_s: float) -> bool:
    """Pause (mode ``keep``: queued and running requests freeze, none is lost) or resume
    ``client``'s engine by the client's own means; False when it has none. Tried in order: an
    in-process ``AsyncLLM``; a client with ``pause_generation`` / ``resume_generation`` methods
    of its own (any wrapper that can pause its engines); vLLM's Ray client (every actor handle's
    ``pause_generation``); a server URL (``/pause?mode=keep``, ``/resume``). An offline ``LLM``
    has no pause."""
    if isinstance(client, AsyncLLMWeightSyncClient):
        engine = client.engine
        client._call(engine.pause_generation(mode="keep") if paused else engine.resume_generation())
        return True
    own = getattr(client, "pause_generation" if paused else "resume_generation", None)
    if callable(own):
        own(mode="keep") if paused else own()
        return True
    handles = getattr(client, "handles", None)
    if isinstance(handles, list) and handles and all(hasattr(h, "pause_generation") for h in handles):
        import ray  # vLLM's RayVLLMWeightSyncClient: the handles are AsyncLLM actors

        calls = [h.pause_generation.remote(mode="keep") if paused else h.resume_generation.remote()
                 for h in handles]
        ray.get(calls, timeout=timeout_s)
        return True
    base_url = getattr(client, "base_url", "")
    if isinstance(base_url, str) and base_url.startswith(("http://", "https://")):
        _server_post(base_url, "/pause?mode=keep" if paused else "/resume", timeout_s)
        return True
    return False


def current_label(client: Any, timeout_s: float = 30.0) -> str | None:
    """The weight version ``client``'s engine reports now (vLLM's ``weight_version``), or None
    where the client cannot say (a client type this does not know, a server that does not answer)."""
    try:
        if isinstance(client, AsyncLLMWeightSyncClient):
            label = client._call(client.engine.get_weight_version())
        elif isinstance(client, LLMWeightSyncClient):
            label = client.llm.llm_engine.get_weight_version()
        else:
            base_url = getattr(client, "base_url", "")
            if not (isinstance(base_url, str) and base_url.startswith(("http://", "https://"))):
                return None
            with urllib.request.urlopen(f"{base_url.rstrip('/')}/weight_info", timeout=timeout_s) as response:
                label = json.loads(response.read() or b"{}").get("weight_version")
    except Exception:  # noqa: BLE001 - a label we cannot read only means counting starts at 1
        logger.warning("awex_fast: could not read the weight version of %s",
                       getattr(client, "base_url", client))
        return None
    return None if label is None else str(label)


class GenerationHold:
    """Which engines the trainer paused because a round left their weights mixed (module
    docstring). `after_round` is called once per engine and round with that engine's errors."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.held: set[str] = set()

    def after_round(self, name: str, client: Any, errors: list[str]) -> str | None:
        """Pause ``name`` when ``errors`` say its weights are mixed, resume it when the round
        landed (no errors) and it was paused; returns a note for the round's error, or None."""
        if not errors:
            if name in self.held:
                try:
                    _set_paused(client, False, self.timeout_s)
                    self.held.discard(name)
                except Exception:  # the round landed: say so, and retry after the next one
                    logger.exception("awex_fast: resuming generation on %s failed", name)
            return None
        if not any(MIXED_WEIGHTS in e for e in errors):
            return None  # staged: the previous version is whole and keeps serving
        if name in self.held:
            return f"{name}: generation stays paused until a round lands there"
        try:
            if not _set_paused(client, True, self.timeout_s):
                return (f"{name}: its client has no way to pause it (an offline LLM, or a client without "
                        "pause_generation): do not generate until a round lands")
        except Exception as exc:  # noqa: BLE001 - the round's error must still be raised
            return f"{name}: pausing its generation failed ({exc}): do not generate until a round lands"
        self.held.add(name)
        return f"{name}: generation paused (requests kept) until a round lands there"
