"""Rank spaces: transfer-rank bases of the two sides (`transfer_ranks`), moving metadata into
them (`with_rank_offset`), and reading Awex 0.9's metadata objects (`metas_from_awex`)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

from awex_fast.meta.dtypes import dtype_name
from awex_fast.meta.errors import MetadataError, _gc_paused, _short
from awex_fast.meta.shards import ParameterMeta, ShardMeta, ShardRule


def _positive_int(value: Any, what: str) -> int:
    try:
        out = 0 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        out = 0
    if out < 1:
        raise MetadataError(f"{what} must be a positive integer, got {_short(value)}")
    return out


def transfer_ranks(engine_sizes: Sequence[int], train_world_size: int) -> tuple[list[int], int]:
    """Transfer-rank bases: inference engine ``e`` starts at ``infer_bases[e]`` (prefix sums of
    ``engine_sizes``; engines may differ in size), training ranks start at ``train_base`` (after
    every inference rank). ``infer_bases[e] + r`` is engine ``e``'s local rank ``r``."""
    bases: list[int] = []
    total = 0
    for e, size in enumerate(engine_sizes):
        bases.append(total)
        total += _positive_int(size, f"engine {e} size")
    _positive_int(train_world_size, "train_world_size")
    return bases, total


@_gc_paused()
def with_rank_offset(metas: Iterable[ParameterMeta], offset: int) -> list[ParameterMeta]:
    """Copies of ``metas`` with every rank (explicit shards and rules) shifted by ``offset``:
    side-local ranks -> transfer ranks. A shift to a negative rank raises `MetadataError`."""
    try:
        offset = operator.index(offset)
    except TypeError:
        raise MetadataError(f"rank offset must be an integer, got {_short(offset)}") from None
    if offset == 0:
        return list(metas)
    moved: dict[ShardRule, ShardRule] = {}
    out = []
    for m in metas:
        shards = tuple(ShardMeta(s.rank + offset, s.global_offset, s.shape, s.local_offset) for s in m.shards)
        rules = []
        for r in m.rules:
            new = moved.get(r)
            if new is None:
                ranks = tuple(map(offset.__add__, r.ranks))
                if ranks and min(ranks) < 0:
                    raise MetadataError(f"parameter {m.name!r}: offset {offset} gives rank {min(ranks)}")
                new = ShardRule._of_ints(ranks, r.split_dims, r.num_chunks, r.replicas, r.local_offset)
                moved[r] = new
            rules.append(new)
        low = min((s.rank for s in shards), default=0)
        if low < 0:
            raise MetadataError(f"parameter {m.name!r}: offset {offset} gives negative rank {low}")
        out.append(ParameterMeta(m.name, m.global_shape, m.dtype, shards, tuple(rules)))
    return out


def metas_from_awex(objs: Iterable[Any], rank_offset: int = 0) -> list[ParameterMeta]:
    """Convert Awex ``ParameterMeta`` objects (duck-typed: ``name``, ``global_shape``, ``dtype`` as a
    ``torch.dtype``, ``shards`` with ``global_rank``, ``global_offset``, ``shape``; other attributes
    such as ``engine_rank``, ``world_size`` and ``replicas`` are ignored) into ours, one per object
    in input order; a piece's rank is ``global_rank + rank_offset``. An empty ``global_offset``
    (Awex's default before offsets are resolved) means zeros. Pass per-rank objects through
    `merge_metas` afterwards."""
    out = []
    for i, obj in enumerate(objs):
        label = f"awex meta {i} ({getattr(obj, 'name', '?')!r})"
        try:
            name, gshape, dtype, src = obj.name, tuple(obj.global_shape), obj.dtype, list(obj.shards)
            shards = []
            for k, sh in enumerate(src):
                try:
                    offset, shape = tuple(sh.global_offset), tuple(sh.shape)
                    rank = operator.index(sh.global_rank) + rank_offset
                    shards.append(ShardMeta(rank, offset or (0,) * len(shape), shape))
                except AttributeError as exc:
                    raise MetadataError(f"{label}: shards[{k}] lacks {exc.name!r}") from None
                except MetadataError as exc:
                    raise MetadataError(f"{label}: shards[{k}]: {exc}") from None
        except AttributeError as exc:
            raise MetadataError(f"{label} lacks the attribute {exc.name!r}") from None
        except TypeError as exc:
            raise MetadataError(f"{label}: {exc}") from None
        out.append(ParameterMeta(str(name), gshape, dtype_name(dtype), tuple(shards)))
    return out
