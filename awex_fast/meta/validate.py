"""`validate_metas`: bounds, ranks, dtypes and overlaps of a metadata list, with errors that
name the parameter, the rank and the boxes. Rules are checked once per (rule, shape); only ranks
holding more than one piece of a parameter have their pieces materialised and swept."""

from __future__ import annotations

import heapq
import itertools
import operator
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from awex_fast.meta.dtypes import _DTYPE_ITEMSIZE
from awex_fast.meta.errors import MetadataError, _fmt_box
from awex_fast.meta.shards import ParameterMeta, ShardMeta, ShardRule

# A box in one rank's pieces: (offset, shape, description of where it came from).
_Box = tuple[tuple[int, ...], tuple[int, ...], str]


def _find_overlap(boxes: list[_Box]) -> tuple[_Box, _Box] | None:
    """Two overlapping non-empty boxes, or None. Sort-and-sweep along the dim with the most
    distinct start coordinates: O(n log n + n * A * ndim), A the largest number of boxes whose
    extents on that dim share a point (1 for pieces cut along it, so O(n log n) in practice)."""
    if len(boxes[0][0]) == 0:  # 0-d: every non-empty piece is the whole scalar
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None
    nd = len(boxes[0][0])
    d = max(range(nd), key=lambda k: len({b[0][k] for b in boxes}))
    his = [tuple(map(operator.add, b[0], b[1])) for b in boxes]
    active: list[tuple[int, int]] = []  # heap of (end on dim d, box index)
    for start, i in sorted((b[0][d], i) for i, b in enumerate(boxes)):
        while active and active[0][0] <= start:
            heapq.heappop(active)
        lo, hi = boxes[i][0], his[i]
        for _, j in active:
            if all(map(operator.lt, lo, his[j])) and all(map(operator.lt, boxes[j][0], hi)):
                return boxes[j], boxes[i]
        heapq.heappush(active, (hi[d], i))
    return None


def _rule_piece(rule: ShardRule, k: int, pos: int, gshape: tuple[int, ...]) -> tuple[_Box, _Box]:
    """(global box, local box) of the piece at position ``pos`` of ``rules[k]``."""
    total = rule.total_chunks
    offset, shape = rule.cell_box(gshape, pos % total)
    where = f"rules[{k}] cell {pos % total} replica {pos // total}"
    local = rule.local_offset if rule.local_offset is not None else (0,) * len(gshape)
    return (offset, shape, where), (local, shape, where)


def _overlap(name: str, rank: int, space: str, a: _Box, b: _Box) -> MetadataError:
    return MetadataError(
        f"parameter {name!r}: rank {rank} holds overlapping pieces in {space} space: "
        f"{a[2]} box {_fmt_box(a[0], a[1])} and {b[2]} box {_fmt_box(b[0], b[1])}"
    )


def _check_shard(name: str, g: tuple[int, ...], k: int, s: ShardMeta) -> None:
    inside = all(o >= 0 and o + n <= e for o, n, e in zip(s.global_offset, s.shape, g, strict=True))
    bad = (
        "negative rank" if s.rank < 0
        else f"outside global_shape {g}" if not inside
        else f"negative local_offset {s.local_offset}" if min(s.local, default=0) < 0
        else None
    )  # fmt: skip
    if bad is not None:
        box = _fmt_box(s.global_offset, s.shape)
        raise MetadataError(f"parameter {name!r}: shards[{k}] of rank {s.rank}, box {box}: {bad}")


def _check_rule(name: str, g: tuple[int, ...], k: int, rule: ShardRule) -> tuple[Sequence[int], ...]:
    """Checks one rule alone; returns (positions into ranks of its pieces, the ranks there)."""
    positions, held = rule._held(g)
    positions = range(len(held)) if positions is None else positions
    if held and min(held) < 0:
        i = next(i for i, r in enumerate(held) if r < 0)
        off, shape, where = _rule_piece(rule, k, positions[i], g)[0]
        box = _fmt_box(off, shape)
        raise MetadataError(f"parameter {name!r}: {where} has negative rank {held[i]} (box {box})")
    if min(rule.local_offset or (), default=0) < 0:
        raise MetadataError(f"parameter {name!r}: rules[{k}] has negative local_offset {rule.local_offset}")
    if len(set(held)) != len(held):  # a rank with two pieces of one rule: same cell or same local box
        first: dict[int, int] = {}
        for i, r in enumerate(held):
            if r in first:
                p, q = positions[first[r]], positions[i]
                same_cell = p % rule.total_chunks == q % rule.total_chunks
                gp, lp = _rule_piece(rule, k, p, g)
                gq, lq = _rule_piece(rule, k, q, g)
                raise _overlap(name, r, "global", gp, gq) if same_cell else _overlap(name, r, "local", lp, lq)
            first[r] = i
    return positions, held


# (id(rule), global_shape) -> (rule, positions, held); holding the rule keeps its id unique.
_RuleCache = dict[tuple[int, tuple[int, ...]], tuple[ShardRule, Sequence[int], Sequence[int]]]


def _shards_in_bounds(shards: Sequence[ShardMeta], g: tuple[int, ...]) -> bool:
    """Whether every explicit piece has a non-negative rank and local offset and lies inside
    ``g``: one pass of C-level iterators over all pieces (validating 100k explicit pieces is then
    a few ms, not a Python loop per piece); `_check_shard` names the culprit when this fails."""
    if min(map(_RANK, shards)) < 0:
        return False
    offsets = list(itertools.chain.from_iterable(map(_GLOBAL_OFFSET, shards)))
    if min(offsets, default=0) < 0:
        return False
    ends = map(operator.add, offsets, itertools.chain.from_iterable(map(_SHAPE, shards)))
    if not all(map(operator.le, ends, itertools.cycle(g))):
        return False
    locals_ = itertools.chain.from_iterable(filter(None, map(_LOCAL_OFFSET, shards)))
    return min(locals_, default=0) >= 0


_RANK = operator.attrgetter("rank")
_GLOBAL_OFFSET = operator.attrgetter("global_offset")
_SHAPE = operator.attrgetter("shape")
_LOCAL_OFFSET = operator.attrgetter("local_offset")


def _validate_param(m: ParameterMeta, cache: _RuleCache) -> None:
    name, g = m.name, m.global_shape
    if m.dtype not in _DTYPE_ITEMSIZE:
        raise MetadataError(f"parameter {name!r}: unknown dtype {m.dtype!r}")
    shards = m.shards
    if shards and not _shards_in_bounds(shards, g):
        for k, s in enumerate(shards):
            _check_shard(name, g, k, s)
    holders = []
    for k, rule in enumerate(m.rules):
        hit = cache.get((id(rule), g))
        if hit is None or hit[0] is not rule:
            hit = cache[(id(rule), g)] = (rule, *_check_rule(name, g, k, rule))
        holders.append(hit[1:])
    if not shards and len(holders) < 2:  # the common generated layout: one rule, checked above
        return
    # Only a rank holding more than one piece can overlap itself: count pieces per rank (C-level
    # work) and materialise just those ranks' pieces. A rule's own cells are disjoint and a rank
    # listed twice in one rule was caught by `_check_rule`.
    counts = Counter(map(_RANK, shards))
    if not holders and len(counts) == len(shards):
        return
    for _, held in holders:
        counts.update(held)
    shared = {r for r, c in counts.items() if c > 1}
    if not shared:
        return
    # rank -> [(global box, local box)] of its non-empty pieces
    by_rank: defaultdict[int, list[tuple[_Box, _Box]]] = defaultdict(list)
    for k, s in enumerate(shards):
        if s.rank in shared and 0 not in s.shape:
            tag = f"shards[{k}]"
            by_rank[s.rank].append(((s.global_offset, s.shape, tag), (s.local, s.shape, tag)))
    for k, (positions, held) in enumerate(holders):
        if not shared.isdisjoint(held):
            for i, r in enumerate(held):
                if r in shared:
                    by_rank[r].append(_rule_piece(m.rules[k], k, positions[i], g))
    for r, pieces in by_rank.items():
        if len(pieces) > 1:
            for space, idx in (("global", 0), ("local", 1)):
                hit = _find_overlap([p[idx] for p in pieces])
                if hit is not None:
                    raise _overlap(name, r, space, *hit)


def validate_metas(metas: Iterable[ParameterMeta]) -> None:
    """Check a metadata list; raise `MetadataError` naming the parameter, the rank and the box.

    Checks: names unique; dtype known; ranks non-negative; every piece inside the global shape
    (ndim and rule dims are checked when the objects are built); local offsets non-negative; no
    two non-empty pieces of one rank overlapping in global space or in the rank's local tensor.
    A rule's own cells are disjoint, so a rule costs O(len(ranks)) C-level work (a set of its
    ranks) unless a rank appears twice in it or also in another source of the same parameter;
    only those ranks' pieces are materialised and swept (see `_find_overlap`).
    """
    seen: set[str] = set()
    cache: _RuleCache = {}
    known = _DTYPE_ITEMSIZE
    for i, m in enumerate(metas):
        if type(m) is not ParameterMeta and not isinstance(m, ParameterMeta):
            raise MetadataError(f"metas[{i}] is {type(m).__name__}, not ParameterMeta")
        name, rules = m.name, m.rules
        if name in seen:
            raise MetadataError(f"parameter {name!r} appears more than once (again at metas[{i}])")
        seen.add(name)
        # Fast path (70k-tensor generated layouts): one rule, already checked for this shape.
        if len(rules) == 1 and not m.shards and m.dtype in known:
            hit = cache.get((id(rules[0]), m.global_shape))
            if hit is not None and hit[0] is rules[0]:
                continue
        _validate_param(m, cache)
