"""What a trainer rank sends from, as tensors: a generic `WeightSource` read each round
(`SourceTensors`), named DTensors under canonical names (`ShardedSource`), and the checks that
tell whether a source still matches the plan made at the join (`fingerprints`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from awex_fast.meta import MetadataError, ParameterMeta, ShardMeta, dtype_name
from awex_fast.sync.adapter_base import local_tensor
from awex_fast.transfer.executor import first_fingerprint_difference, metadata_fingerprints

__all__ = ["ShardedSource", "SourceTensors", "check_module_shapes", "fingerprints", "first_change"]


class SourceTensors:
    """A generic `WeightSource` as local tensors: this rank holds its held names whole (a
    replica of each). Iterating is the source's collective, so every rank iterates each round."""

    def __init__(self, source: WeightSource, rank: int) -> None:
        self.source, self.rank = source, rank
        held = source.held_names()
        self.meta = source.metadata()
        self.held: Collection[str] | None = set(held) if held is not None else None
        self.current: dict[str, torch.Tensor] = {}

    def metas(self) -> list[ParameterMeta]:
        out = []
        for m in self.meta:
            if self.held is None or m.name in self.held:
                shape = tuple(int(s) for s in m.shape)
                out.append(ParameterMeta(m.name, shape, dtype_name(m.dtype),
                                         [ShardMeta(self.rank, (0,) * len(shape), shape)]))
        return out

    def refresh(self) -> None:
        """Iterate the source once (collective) and keep this rank's held tensors, checking each
        against the declared metadata before anything is sent. The metadata is read again too:
        a source may declare other shapes from one round to the next (then the round re-plans)."""
        held = self.source.held_names()
        self.meta = self.source.metadata()
        self.held = set(held) if held is not None else None
        declared = {m.name: m for m in self.meta}
        got: dict[str, torch.Tensor] = {}
        for name, tensor in self.source:
            if tensor is None or (self.held is not None and name not in self.held):
                continue
            m = declared.get(name)
            if m is None:
                raise MetadataError(f"WeightSource yielded {name!r}, which metadata() does not declare")
            if tuple(tensor.shape) != tuple(m.shape) or tensor.dtype != m.dtype:
                raise MetadataError(f"WeightSource yielded {name!r} as {tuple(tensor.shape)} {tensor.dtype}; "
                                    f"metadata() declares {tuple(m.shape)} {m.dtype}")
            got[name] = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        missing = sorted(n for n in (m.name for m in self.metas()) if n not in got)
        if missing:
            raise MetadataError(f"WeightSource did not yield held parameters {missing[:5]}")
        self.current = got


class ShardedSource(WeightSource):
    """A `WeightSource` over named DTensors (FSDP2 / TP / 2-D) or plain tensors under their
    canonical (Hugging Face) names, for trainers whose parameters are not one module's
    ``named_parameters()`` (renamed, or with tied aliases dropped). awex_fast sends each rank's
    local shards; iterating it (for other backends) gathers full tensors, a collective."""

    def __init__(self, named: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self.named = named

    def metadata(self) -> list[ParamMeta]:
        """(name, dtype, global shape) of every tensor, without gathering."""
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.named().items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.named().items():
            full = getattr(t, "full_tensor", None)
            yield name, full() if callable(full) else t


def check_module_shapes(module: nn.Module, metas: Sequence[ParameterMeta]) -> None:
    """Local shards must be the size their metadata says (a stale ``.data`` rebinding would
    otherwise send or receive the wrong bytes)."""
    by_name = dict(module.named_parameters())
    for m in metas:
        t = by_name.get(m.name)
        if t is None:
            continue
        local = local_tensor(t)
        for piece in m.shards:
            end = [o + s for o, s in zip(piece.local, piece.shape, strict=True)]
            if len(end) != local.dim() or any(e > d for e, d in zip(end, local.shape, strict=True)):
                raise MetadataError(f"trainer parameter {m.name!r}: local tensor {tuple(local.shape)} does "
                                    f"not hold piece {piece.global_offset}+{piece.shape}")



def fingerprints(metas: Sequence[ParameterMeta]) -> list[tuple[str, str]]:
    """Per parameter, a short hash of this rank's metadata of it (names, shapes, dtypes, pieces)."""
    return metadata_fingerprints([("train", metas)])


def first_change(before: list[tuple[str, str]], now: list[tuple[str, str]]) -> str:
    """Which parameter's metadata changed between two `fingerprints` lists, in words."""
    found = first_fingerprint_difference(before, now)
    if found is None:
        return "the source's metadata changed"
    key, how = found
    name = key.removeprefix("train:")
    return {"gone": f"parameter {name!r} is gone from the source",
            "new": f"parameter {name!r} is new in the source",
            "changed": f"parameter {name!r} changed its shape, dtype or sharding"}[how]
