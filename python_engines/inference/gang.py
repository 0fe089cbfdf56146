"""Weight sync into a running server: the ``/awex/*`` worker routes of every TP rank on rank 0.

Why this shape: a `WeightSyncPair` sees one *worker* per inference rank (engine = list of
workers, each driven through `awex_fast.sync.routes`), but only TP rank 0 of our server has an
HTTP port, and every rank must land an update at the *same* step boundary, or one forward pass
would mix old and new weights across ranks. So rank 0 serves ``/tp/{r}/awex/*`` for every rank
``r`` (``/awex/*`` is rank 0's), each through ``awex_fast.sync.routes(RankProxy(r))``. A proxy
forwards its rank's call to a `Gang`:

- reports (``report_parallelism``, ``report_weight_meta``) are answered for that rank alone
  (the metadata comes from the rank's own `InferenceAdapter`, over the op channel);
- every mutating call waits until the same call arrived for all ``tp_size`` ranks (as the pair
  sends them concurrently; ``gang_timeout_s`` bounds the wait, and a missing rank is named),
  then runs as one ``adapter`` op on the engine loop: all ranks call their adapter between the
  same two steps. An update that fails on any rank marks the weights invalid (generation is
  refused until an update lands); one that lands bumps the version and recomputes the KV cache
  of running requests (`python_engines.inference.loop.EngineLoop.run_adapter`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from awex_fast.meta import ParameterMeta, metas_from_b64

if TYPE_CHECKING:
    from python_engines.inference.loop import EngineLoop

__all__ = ["Gang", "GangError", "RankProxy"]


class GangError(RuntimeError):
    """A rank's part of a collective adapter call failed, or not every rank called in time."""


@dataclass
class _Round:
    calls: list[dict[str, Any] | None]
    done: threading.Event = field(default_factory=threading.Event)
    results: list[dict[str, Any]] | None = None
    error: BaseException | None = None


class Gang:
    """Assembles one call per TP rank into a single op on the engine loop (module docstring)."""

    def __init__(self, engine: EngineLoop, tp_size: int, timeout_s: float, call_timeout_s: float) -> None:
        """``timeout_s`` bounds the wait for every rank's call; ``call_timeout_s`` the op itself."""
        self.engine = engine
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self.call_timeout_s = call_timeout_s
        self._cond = threading.Condition()
        self._open: dict[str, _Round] = {}

    def _finish(self, rnd: _Round, rank: int, method: str) -> Any:
        if not rnd.done.wait(self.call_timeout_s):
            raise GangError(f"{method} for TP rank {rank}: no result within {self.call_timeout_s:.0f} s")
        if rnd.error is not None:
            raise GangError(f"{method} for TP rank {rank} failed: {rnd.error}") from rnd.error
        assert rnd.results is not None
        mine = rnd.results[rank]
        if not mine["ok"]:
            raise GangError(f"{method}: {mine['error']}")
        return mine["value"]

    def _launch(self, rnd: _Round, method: str) -> None:
        fut = self.engine.call(lambda: self.engine.run_adapter(method, rnd.calls))

        def done(f: Any) -> None:
            if f.exception() is not None:
                rnd.error = f.exception()
            else:
                rnd.results = f.result()
            rnd.done.set()

        fut.add_done_callback(done)

    def single(self, rank: int, method: str, kwargs: dict[str, Any] | None = None) -> Any:
        """Run ``method`` on rank ``rank`` alone (other ranks idle through the op)."""
        calls: list[dict[str, Any] | None] = [None] * self.tp_size
        calls[rank] = {"method": method, "kwargs": kwargs or {}}
        rnd = _Round(calls)
        self._launch(rnd, method)
        return self._finish(rnd, rank, method)

    def collective(self, rank: int, method: str, kwargs: dict[str, Any] | None = None) -> Any:
        """Register rank ``rank``'s call; run all ranks' calls together once every rank called."""
        call = {"method": method, "kwargs": kwargs or {}}
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            rnd = self._open.get(method)
            if rnd is None:
                rnd = self._open[method] = _Round([None] * self.tp_size)
            if rnd.calls[rank] is not None:
                raise GangError(f"{method}: a second call for TP rank {rank} arrived before every "
                                "rank's first")
            rnd.calls[rank] = call
            if all(c is not None for c in rnd.calls):
                del self._open[method]
                self._launch(rnd, method)
            while not rnd.done.is_set() and any(c is None for c in rnd.calls):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r, c in enumerate(rnd.calls) if c is None]
                    if self._open.get(method) is rnd:
                        del self._open[method]
                    rnd.error = GangError(f"{method}: TP rank(s) {missing} never called within "
                                          f"{self.timeout_s:.0f} s; every rank of an engine must be driven")
                    rnd.done.set()
                    self._cond.notify_all()
                    break
                self._cond.wait(min(left, 0.5))
            self._cond.notify_all()
        return self._finish(rnd, rank, method)


class RankProxy:
    """The `awex_fast.AwexInferenceAdapter` face of TP rank ``rank``, for
    ``awex_fast.sync.routes``; calls go through the `Gang` (module docstring)."""

    def __init__(self, gang: Gang, rank: int, tp_size: int, admin_api_key: str) -> None:
        """Proxy for ``rank`` of an engine of ``tp_size`` ranks."""
        self.gang, self.rank, self.tp_size = gang, rank, tp_size
        self.admin_api_key = admin_api_key

    @property
    def parallelism_strategy(self) -> dict:
        """The same dict the rank's `InferenceAdapter` reports (an engine is one TP group)."""
        return {"world_size": self.tp_size, "tp_size": self.tp_size, "pp_size": 1, "dp_size": 1,
                "ep_size": 1, "rank": self.rank}

    def get_weight_metadata(self) -> list[ParameterMeta]:
        """The rank's pieces, from its own adapter."""
        return metas_from_b64(self.gang.single(self.rank, "get_weight_metadata"), what=f"TP rank {self.rank}")

    def get_local_shard_parameters(self, required_names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Not available here: the tensors live in TP rank ``rank``'s own process."""
        raise TypeError(f"TP rank {self.rank}'s tensors live in its worker process; only its adapter there "
                        "hands them out")

    def init_weight_update_group(self, **kwargs: Any) -> Any:
        """Every rank joins the transfer group together."""
        return self.gang.collective(self.rank, "init_weight_update_group", kwargs)

    def execute_weight_update(self, version: int) -> Any:
        """Every rank receives its buckets between the same two steps."""
        return self.gang.collective(self.rank, "execute_weight_update", {"version": version})

    def batch_isend_irecv(self, **kwargs: Any) -> Any:
        """The warm-up exchange on every rank."""
        return self.gang.collective(self.rank, "batch_isend_irecv", kwargs)

    def teardown_weight_update_group(self) -> Any:
        """Every rank leaves the transfer group."""
        return self.gang.collective(self.rank, "teardown_weight_update_group", {})

    def init_colocate_weight_update(self, **kwargs: Any) -> Any:
        """Every rank prepares colocated updates."""
        return self.gang.collective(self.rank, "init_colocate_weight_update", kwargs)

    def execute_colocate_weight_update(self, version: int) -> Any:
        """Every rank copies its boxes between the same two steps."""
        return self.gang.collective(self.rank, "execute_colocate_weight_update", {"version": version})

    def release_memory(self, tags: list[str] | None = None) -> Any:
        """Every rank frees ``tags`` ("weights", "kv_cache"); running requests are interrupted."""
        return self.gang.collective(self.rank, "release_memory", {"tags": tags})

    def resume_memory(self, tags: list[str] | None = None) -> Any:
        """Every rank restores ``tags``; weights stay unusable until the next update lands."""
        return self.gang.collective(self.rank, "resume_memory", {"tags": tags})
