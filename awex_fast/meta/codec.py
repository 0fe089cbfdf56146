"""Versioned JSON for shard metadata (`metas_to_json` / `metas_from_json`), and the one base64
form of it that travels inside JSON values (`metas_to_b64` / `metas_from_b64`).

Compact by design: a top-level rule table that parameters reference by index (70k MoE tensors
share a handful of rules), rank lists with ``[start, stop, step]`` runs, empty fields left out.
Unknown formats, versions and fields, wrong types and non-UTF-8 input raise `MetadataError`.
Never pickle. `awex_fast.meta` (and `awex_fast`) export these names.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from awex_fast.meta.errors import MetadataError, _gc_paused, _short
from awex_fast.meta.merge import merge_metas
from awex_fast.meta.shards import ParameterMeta, ShardMeta, ShardRule
from awex_fast.meta.validate import validate_metas

# ---- JSON (de)serialisation ------------------------------------------------------------------

FORMAT_TAG = "awex_fast.metas"
FORMAT_VERSION = 1
_MAX_RULE_RANKS = 1 << 24  # a decoded rule may list at most 16M ranks (guards range triples)
_TOP_KEYS = frozenset({"format", "version", "rules", "params"})
_PARAM_KEYS = frozenset({"name", "shape", "dtype", "shards", "rules"})


def _encode_ranks(ranks: tuple[int, ...]) -> Sequence[Any]:
    """Rank tuple -> JSON items: ints, and ``[start, stop, step]`` for arithmetic runs of >= 4."""
    n = len(ranks)
    if n < 4:
        return ranks
    first, step = ranks[0], ranks[1] - ranks[0]
    end = first + step * n
    if step and ranks[-1] == end - step and ranks == tuple(range(first, end, step)):
        return [[first, end, step]]
    diffs = list(map(operator.sub, ranks[1:], ranks[:-1]))
    if 2 * len(set(diffs)) > len(diffs):  # mostly irregular: runs cannot save much
        return ranks
    out: list[Any] = []
    i = 0
    while i < n:
        k = i
        if i + 1 < n and diffs[i]:
            k = i + 1
            while k < n - 1 and diffs[k] == diffs[i]:
                k += 1
        if k - i + 1 >= 4:
            out.append([ranks[i], ranks[i] + diffs[i] * (k - i + 1), diffs[i]])
            i = k + 1
        else:
            out.append(ranks[i])
            i += 1
    return out


@_gc_paused()
def metas_to_json(metas: Iterable[ParameterMeta]) -> bytes:
    """Serialise metas to the versioned JSON format (module docstring) as ASCII bytes.

    Deterministic: equal inputs in equal order give equal bytes. Distinct rules go once into
    the top-level table, in order of first use; parameters refer to them by index.
    """
    table: list[list[Any]] = []
    by_value: dict[ShardRule, int] = {}
    by_id: dict[int, tuple[ShardRule, int]] = {}  # holds the rule, so its id stays unique
    params: list[dict[str, Any]] = []
    for i, m in enumerate(metas):
        if not isinstance(m, ParameterMeta):
            raise MetadataError(f"metas[{i}] is {type(m).__name__}, not ParameterMeta")
        entry: dict[str, Any] = {"name": m.name, "shape": m.global_shape, "dtype": m.dtype}
        if m.shards:
            entry["shards"] = [
                (s.rank, s.global_offset, s.shape)
                if s.local_offset is None
                else (s.rank, s.global_offset, s.shape, s.local_offset)
                for s in m.shards
            ]
        if m.rules:
            refs = []
            for r in m.rules:
                hit = by_id.get(id(r))
                if hit is None or hit[0] is not r:
                    idx = by_value.get(r)
                    if idx is None:
                        idx = by_value[r] = len(table)
                        enc = [_encode_ranks(r.ranks), r.split_dims, r.num_chunks, r.replicas]
                        table.append(enc if r.local_offset is None else [*enc, r.local_offset])
                    hit = by_id[id(r)] = (r, idx)
                refs.append(hit[1])
            entry["rules"] = refs
        params.append(entry)
    doc = {"format": FORMAT_TAG, "version": FORMAT_VERSION, "rules": table, "params": params}
    return json.dumps(doc, separators=(",", ":")).encode("ascii")


def _ints(value: Any, where: Callable[[], str], what: str) -> tuple[int, ...]:
    # ``where`` builds the location text only on error: formatting it per field costs more than
    # the rest of decoding a parameter.
    if type(value) is not list or not all(type(v) is int for v in value):
        raise MetadataError(f"{where()} {what} must be a list of integers, got {_short(value)}")
    return tuple(value)


def _decode_ranks(enc: Any, expected: int, what: str) -> tuple[int, ...]:
    if type(enc) is not list:
        raise MetadataError(f"{what} must be a list of ranks and [start, stop, step] ranges")
    kinds = set(map(type, enc))
    if not kinds <= {int, list}:
        raise MetadataError(f"{what} items must be ranks or [start, stop, step], got {_short(enc)}")
    out: list[int] = enc if list not in kinds else []
    if list in kinds:
        for item in enc:
            if type(item) is int:
                out.append(item)
                continue
            if len(item) != 3 or not all(type(v) is int for v in item) or item[2] == 0:
                raise MetadataError(f"{what}: range {_short(item)} must be [start, stop, step], step != 0")
            start, stop, step = item
            # The length by arithmetic, not len(range(...)): a range longer than sys.maxsize
            # (such as [0, 2**63, 1]) makes len() raise OverflowError.
            count = max(0, (stop - start + step - (1 if step > 0 else -1)) // step)
            if len(out) + count > expected:
                raise MetadataError(f"{what} lists more ranks than the rule's grid needs ({expected})")
            out.extend(range(start, stop, step))
    if len(out) != expected:
        raise MetadataError(f"{what} lists {len(out)} ranks, the rule's grid needs {expected}")
    return tuple(out)


def _decode_rule(enc: Any, what: str) -> ShardRule:
    if type(enc) is not list or len(enc) not in (4, 5):
        raise MetadataError(
            f"{what} must be [ranks, split_dims, num_chunks, replicas(, local_offset)], got {_short(enc)}"
        )
    here = lambda: what  # noqa: E731
    split_dims, num_chunks = _ints(enc[1], here, "split_dims"), _ints(enc[2], here, "num_chunks")
    replicas = enc[3]
    if type(replicas) is not int or replicas < 1 or min(num_chunks, default=1) < 1:
        raise MetadataError(f"{what}: num_chunks {num_chunks} and replicas {replicas!r} must be ints >= 1")
    local = _ints(enc[4], here, "local_offset") if len(enc) == 5 else None
    expected = math.prod(num_chunks) * replicas
    if expected > _MAX_RULE_RANKS:
        raise MetadataError(f"{what}: a grid of {expected} pieces exceeds the limit {_MAX_RULE_RANKS}")
    ranks = _decode_ranks(enc[0], expected, f"{what} ranks")
    try:
        return ShardRule._of_ints(ranks, split_dims, num_chunks, replicas, local)
    except MetadataError as exc:
        raise MetadataError(f"{what}: {exc}") from None


def _decode_shard(enc: Any, where: Callable[[], str], k: int) -> ShardMeta:
    here = lambda: f"{where()} shards[{k}]"  # noqa: E731
    if type(enc) is not list or len(enc) not in (3, 4) or type(enc[0]) is not int:
        raise MetadataError(f"{here()} must be [rank, offset, shape(, local_offset)], got {_short(enc)}")
    offset, shape = _ints(enc[1], here, "offset"), _ints(enc[2], here, "shape")
    local = _ints(enc[3], here, "local_offset") if len(enc) == 4 else None
    try:
        return ShardMeta(enc[0], offset, shape, local)
    except MetadataError as exc:
        raise MetadataError(f"{here()}: {exc}") from None


def _decode_param(p: Any, i: int, table: list[ShardRule]) -> ParameterMeta:
    if type(p) is not dict:
        raise MetadataError(f"params[{i}] must be an object, got {_short(p)}")
    try:
        name, shape, dtype = p["name"], p["shape"], p["dtype"]
    except KeyError as exc:
        raise MetadataError(f"params[{i}] lacks the field {exc.args[0]!r}") from None
    if not p.keys() <= _PARAM_KEYS:
        raise MetadataError(f"params[{i}] has unknown fields {sorted(p.keys() - _PARAM_KEYS)}")
    if type(name) is not str or not name:
        raise MetadataError(f"params[{i}] name must be a non-empty string, got {_short(name)}")
    where = lambda: f"params[{i}] ({name!r})"  # noqa: E731
    shape = _ints(shape, where, "shape")
    if type(dtype) is not str or not dtype:
        raise MetadataError(f"{where()} dtype must be a non-empty string, got {_short(dtype)}")
    shards: tuple[ShardMeta, ...] = ()
    if "shards" in p:
        if type(p["shards"]) is not list:
            raise MetadataError(f"{where()} shards must be a list, got {_short(p['shards'])}")
        shards = tuple(_decode_shard(s, where, k) for k, s in enumerate(p["shards"]))
    rules: tuple[ShardRule, ...] = ()
    if "rules" in p:
        refs = _ints(p["rules"], where, "rules")
        if refs and (min(refs) < 0 or max(refs) >= len(table)):
            raise MetadataError(f"{where()} rules {list(refs)} index past the {len(table)}-entry rule table")
        rules = tuple(table[r] for r in refs)
    return ParameterMeta(name, shape, dtype, shards, rules)


@_gc_paused()
def metas_from_json(
    data: bytes | bytearray | memoryview | str, *, validate: bool = True
) -> list[ParameterMeta]:
    """Parse `metas_to_json` output. Raises `MetadataError` naming the defect for input that is
    not UTF-8, not JSON, of another format or version, or of the wrong shape or types (a JSON
    ``true`` is not an integer), and for metadata `validate_metas` refuses once entries of one
    name are merged (a name given with two shapes or dtypes, an unknown dtype, a piece outside
    the global shape, two pieces of one rank overlapping; ``validate=False`` skips those, for
    tools that inspect metadata as it was written).
    Parameters sharing a table rule share one `ShardRule` object."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MetadataError(f"metas JSON is not valid UTF-8: {exc}") from None
    elif isinstance(data, str):
        text = data
    else:
        raise MetadataError(f"metas JSON must be bytes or str, got {type(data).__name__}")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MetadataError(f"metas JSON is malformed: {exc}") from None
    if type(doc) is not dict:
        raise MetadataError(f"metas JSON must be an object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT_TAG:
        raise MetadataError(f"metas JSON format tag is {_short(doc.get('format'))}, expected {FORMAT_TAG!r}")
    version = doc.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise MetadataError(
            f"metas JSON version {_short(version)} is not supported (this build reads {FORMAT_VERSION})"
        )
    if doc.keys() != _TOP_KEYS:
        raise MetadataError(f"metas JSON fields are {sorted(doc)}, expected {sorted(_TOP_KEYS)}")
    rules, params = doc["rules"], doc["params"]
    if type(rules) is not list or type(params) is not list:
        raise MetadataError("metas JSON 'rules' and 'params' must be lists")
    table = [_decode_rule(r, f"rules[{k}]") for k, r in enumerate(rules)]
    metas = [_decode_param(p, i, table) for i, p in enumerate(params)]
    if validate:
        # Entries of one name (per-rank lists published unmerged) are checked merged, as the
        # planner reads them; the list is returned as written.
        names = {m.name for m in metas}
        validate_metas(metas if len(names) == len(metas) else merge_metas([metas]))
    return metas


def metas_to_b64(metas: Iterable[ParameterMeta]) -> str:
    """`metas_to_json`, base64-encoded to ASCII: the form metadata takes inside a JSON value
    (worker reports, KV values). `metas_from_b64` is its inverse."""
    return base64.b64encode(metas_to_json(metas)).decode("ascii")


def metas_from_b64(text: str | bytes, *, what: str) -> list[ParameterMeta]:
    """Inverse of `metas_to_b64`, always validated (`metas_from_json` with validation). ``what``
    names the source (a worker, a KV key, a group) in every error: input that is not a string,
    not strict base64, or not valid metas JSON raises `MetadataError` starting with ``what``."""
    if not isinstance(text, (str, bytes)):
        raise MetadataError(f"{what}: metadata must be a base64 string, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MetadataError(f"{what}: metadata is not base64: {exc}") from None
    try:
        return metas_from_json(raw)
    except MetadataError as exc:
        raise MetadataError(f"{what}: {exc}") from None
