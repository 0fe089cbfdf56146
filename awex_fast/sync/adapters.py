"""The awex adapters: `TrainingAdapter` and `InferenceAdapter` implement the protocol of
`awex_fast.sync.protocol` (AReaL's weight-update gateway's members and arguments, contract in
that module) over any source of named local tensors: an ``nn.Module`` (DTensor / FSDP2 / TP or
plain parameters) or a callable returning canonical views (e.g. fused-layout views of an
inference engine), so they serve our engines and anyone else's. What the seed signatures have no
place for is taken at construction: the admin key (default ``$AWEX_FAST_ADMIN_KEY``), a
name-mapping function, the transfer backend, timeouts, bucket size. What both share (KV, plan,
group, warm-up, colocated state, memory) is `awex_fast.sync.adapter_base.AdapterBase`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from awex_fast.meta import MetadataError, ParameterMeta
from awex_fast.sync.adapter_base import AdapterBase, Hooks, default_rank, local_tensor
from awex_fast.sync.colocate import share_tensors
from awex_fast.sync.protocol import WeightsNotReadyError
from awex_fast.transport.shm import find_segment

_Metas = Sequence[ParameterMeta] | Callable[[], Sequence[ParameterMeta]] | None


class TrainingAdapter(AdapterBase):
    """`AwexTrainingAdapter` over an ``nn.Module`` (DTensor/FSDP2/TP or plain parameters) or a
    callable returning canonical name -> tensor (DTensors or local tensors).

    ``metas``: for a callable whose tensors are *local* pieces of larger tensors, their metadata
    (a list, or a callable returning one) in side-local ranks; otherwise derived with
    ``metas_from_dtensors`` (a plain tensor is a full replica on this rank). ``name_map`` turns a
    module's parameter names into canonical (Hugging Face) names, None to skip one. ``rank`` /
    ``world_size`` default to the default process group's. ``optimizer`` adds the "optimizer"
    memory tag. ``backend``: "gloo", "nccl", "native-nccl" or "ipc". CPU colocated mode moves plain
    CPU parameters into one shared-memory segment (rebinding ``param.data``); DTensor CPU
    parameters cannot be moved and must come from ``colocate.share_tensors``.
    """

    role = "training"

    def __init__(self, source: nn.Module | Callable[[], Mapping[str, torch.Tensor]], *, metas: _Metas = None,
                 name_map: Callable[[str], str | None] | None = None, rank: int | None = None,
                 world_size: int | None = None, parallelism: Mapping[str, int] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, admin_api_key: str | None = None,
                 backend: str = "gloo", timeout_s: float = 120.0, bucket_bytes: int = 256 << 20,
                 verify: bool = False, offload_dir: str | None = None, release_hooks: Hooks = None) -> None:
        d_rank, d_world = default_rank()
        super().__init__(rank=d_rank if rank is None else rank, admin_api_key=admin_api_key, backend=backend,
                         timeout_s=timeout_s, bucket_bytes=bucket_bytes, verify=verify,
                         offload_dir=offload_dir, release_hooks=release_hooks)
        self.world_size = d_world if world_size is None else int(world_size)
        self.source, self.name_map, self.optimizer = source, name_map, optimizer
        self._metas, self._parallelism = metas, dict(parallelism) if parallelism else None
        self.shared_segments: list[Any] = []

    def set_source(self, source: nn.Module | Callable[[], Mapping[str, torch.Tensor]],
                   metas: _Metas = None) -> None:
        """Read tensors (and, with ``metas``, their metadata) from ``source`` from the next round
        on. Every round reads its source again (`AdapterBase._run_transfer`), so a source that
        hands out new tensors needs nothing; this is for a different source object."""
        with self._lock:
            self.source, self._metas = source, metas

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        if isinstance(self.source, nn.Module):
            out = []
            for raw, p in self.source.named_parameters():
                name = self.name_map(raw) if self.name_map is not None else raw
                if name is not None:
                    out.append((name, p))
            return out
        return list(self.source().items())

    @property
    def parallelism_strategy(self) -> dict:
        """{"world_size", "tp_size", "pp_size", "dp_size", "ep_size", "rank"}: as given at
        construction, else read from the first DTensor's mesh (dims named like tp/pp/ep; the rest
        is data parallel), else pure data parallelism."""
        if self._parallelism is not None:
            return {"rank": self.rank, **self._parallelism}
        sizes = {"tp": 1, "pp": 1, "ep": 1}
        from torch.distributed.tensor import DTensor

        for _, t in self._named():
            if isinstance(t, DTensor):
                mesh = t.device_mesh
                for i, dim in enumerate(mesh.mesh_dim_names or ()):
                    for k in sizes:
                        if k in dim.lower():
                            sizes[k] = mesh.size(i)
                break
        dp = max(1, self.world_size // (sizes["tp"] * sizes["pp"] * sizes["ep"]))
        return {"world_size": self.world_size, "tp_size": sizes["tp"], "pp_size": sizes["pp"], "dp_size": dp,
                "ep_size": sizes["ep"], "rank": self.rank}

    def get_weight_metadata(self) -> list[ParameterMeta]:
        """This rank's pieces (canonical names, training-job rank)."""
        if self._metas is not None:
            return list(self._metas() if callable(self._metas) else self._metas)
        from awex_fast.layouts import metas_from_dtensors

        return metas_from_dtensors(self._named(), self.rank)

    def execute_weight_update(self, version: int) -> dict[str, Any]:
        """Send this rank's buckets for ``version``; returns the executor's stats."""
        with self._lock:
            return self._run_transfer(version)

    def _prepare_colocate(self) -> None:
        named = self._named()
        if not any(local_tensor(t).device.type == "cpu" for _, t in named):
            return
        from torch.distributed.tensor import DTensor

        move = {}
        for name, t in named:
            local = local_tensor(t)
            if local.device.type != "cpu" or find_segment(local) is not None:
                continue
            if isinstance(t, DTensor) or not isinstance(self.source, nn.Module):
                raise MetadataError(f"training rank {self.rank}: CPU tensor {name!r} is not in shared memory "
                                    "and cannot be moved there (a DTensor, or a callable's tensor); allocate "
                                    "it with awex_fast.sync.colocate.share_tensors")
            move[name] = (t, local)
        if move:
            seg, shared = share_tensors({n: loc for n, (_, loc) in move.items()})
            with torch.no_grad():
                for name, (param, _) in move.items():
                    param.data = shared[name]
            self.shared_segments.append(seg)

    def execute_colocate_weight_update(self, version: int) -> dict[str, Any]:
        """Publish handles (in full only when a storage pointer changed), wait for every reader's
        ack. Returns {"republished", "epoch", "seconds"}."""
        with self._lock:
            if self._sender is None:
                raise RuntimeError(f"training rank {self.rank}: call init_colocate_weight_update first")
            t0 = time.perf_counter()
            with self._resident():
                self._prepare_colocate()  # a parameter rebound since the last update moves too
                fresh = self._sender.publish(int(version), self.get_local_shard_parameters())
                self._sender.wait_acks(int(version))
            return {"republished": fresh, "epoch": self._sender.epoch, "seconds": time.perf_counter() - t0}

    def _extra_tags(self) -> list[str]:
        return ["optimizer"] if self.optimizer is not None else []

    def _after_resume(self, tag: str) -> None:
        # Reallocated storage may come back at the old address yet be other memory (a CUDA IPC
        # importer would still read the old allocation): publish the handles anew. Shared
        # segments are restored in place, so their handles stay valid.
        local = self.get_local_shard_parameters().values() if self._sender is not None else ()
        if tag == "weights" and any(find_segment(t) is None for t in local):
            self._sender.forget()

    def _release_tensors(self, tag: str) -> tuple[list[torch.Tensor], bool]:
        if tag == "weights":
            return list(self.get_local_shard_parameters().values()), True
        if tag == "optimizer" and self.optimizer is not None:
            state = self.optimizer.state.values()
            return [local_tensor(v) for st in state for v in st.values() if torch.is_tensor(v)], True
        return super()._release_tensors(tag)


class InferenceAdapter(AdapterBase):
    """`AwexInferenceAdapter` over a callable returning canonical name -> view of the engine's
    memory (fused layouts: views into qkv_proj / gate_up_proj), plus their metadata in
    engine-local ranks (``metas``: a list or a callable; default: ``metas_from_dtensors`` of the
    views, a plain view being a full replica). ``rank``: this worker's rank inside its engine of
    ``engine_size`` ranks (``tp_size`` defaults to it). ``release_hooks`` maps tags such as
    "kv_cache" to (release, resume) callables of the engine.

    ``version`` is the last version that landed completely; ``failed`` / ``last_error`` flag an
    engine whose last update failed; `require_weights` raises while weights are unusable.
    """

    role = "inference"

    def __init__(self, views: Callable[[], Mapping[str, torch.Tensor]], *, metas: _Metas = None,
                 rank: int = 0, engine_size: int = 1, tp_size: int | None = None,
                 admin_api_key: str | None = None, backend: str = "gloo", timeout_s: float = 120.0,
                 bucket_bytes: int = 256 << 20, verify: bool = False, offload_dir: str | None = None,
                 release_hooks: Hooks = None) -> None:
        super().__init__(rank=rank, admin_api_key=admin_api_key, backend=backend, timeout_s=timeout_s,
                         bucket_bytes=bucket_bytes, verify=verify, offload_dir=offload_dir,
                         release_hooks=release_hooks)
        if not 0 <= self.rank < engine_size:
            raise ValueError(f"inference rank {rank} outside an engine of {engine_size} ranks")
        self.views, self.engine_size = views, int(engine_size)
        self.tp_size = self.engine_size if tp_size is None else int(tp_size)
        self._metas = metas
        self.version: int | None = None
        self._weights_valid = True

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.views().items())

    @property
    def parallelism_strategy(self) -> dict:
        """{"world_size": engine size, "tp_size", "pp_size": 1, "dp_size": 1, "ep_size": 1, "rank"}."""
        return {"world_size": self.engine_size, "tp_size": self.tp_size, "pp_size": 1, "dp_size": 1,
                "ep_size": 1, "rank": self.rank}

    def get_weight_metadata(self) -> list[ParameterMeta]:
        """This rank's pieces (canonical names, rank inside the engine)."""
        if self._metas is not None:
            return list(self._metas() if callable(self._metas) else self._metas)
        from awex_fast.layouts import metas_from_dtensors

        return metas_from_dtensors(self._named(), self.rank)

    @property
    def weights_ready(self) -> bool:
        """False while weights are released or after a failed update, until an update lands."""
        return self._weights_valid and not self.failed and "weights" not in self._store.released_tags

    def require_weights(self) -> None:
        """Raise `WeightsNotReadyError` (saying why) unless generation may use the weights."""
        if not self.weights_ready:
            if "weights" in self._store.released_tags:
                why = "released"
            elif self.failed:
                why = f"the last update failed: {self.last_error}"
            else:
                why = "released; no update has landed since they were resumed"
            raise WeightsNotReadyError(f"inference rank {self.rank}: weights are not usable ({why})")

    def _landed(self, version: int) -> None:
        self.version, self._weights_valid = int(version), True
        self.failed, self.last_error = False, None

    def _make_room(self) -> None:
        if "weights" in self._store.released_tags:  # an update lands in freshly allocated memory
            self._store.resume("weights")
            self._weights_valid = False

    def execute_weight_update(self, version: int) -> dict[str, Any]:
        """Receive this rank's buckets for ``version``; ``version`` moves only on success."""
        with self._lock:
            self._make_room()
            stats = self._run_transfer(version)
            self._landed(version)
            return stats

    def execute_colocate_weight_update(self, version: int) -> dict[str, Any]:
        """Map the training ranks' handles, copy this rank's boxes, acknowledge."""
        with self._lock:
            if self._receiver is None:
                raise RuntimeError(f"inference rank {self.rank}: call init_colocate_weight_update first")
            self._make_room()
            try:
                stats = self._receiver.run(int(version), self.get_local_shard_parameters())
            except Exception as exc:
                self._fail(exc)
                raise
            self._landed(version)
            return stats

    def _release_tensors(self, tag: str) -> tuple[list[torch.Tensor], bool]:
        if tag == "weights":
            return list(self.get_local_shard_parameters().values()), False
        return super()._release_tensors(tag)

    def _after_resume(self, tag: str) -> None:
        if tag == "weights":
            self._weights_valid = False  # contents were not kept: wait for the next update



__all__ = ["InferenceAdapter", "TrainingAdapter"]
