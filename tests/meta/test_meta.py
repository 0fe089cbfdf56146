"""Tests for awex_fast.meta (shards, validate, merge, ranks, codec): construction checks, rule
expansion against torch.chunk, the JSON format (round trips and every rejection), merging,
validation, rank spaces, Awex conversion, and the size/speed of a Kimi-K2-sized layout."""

from __future__ import annotations

import itertools
import json
import random
import re
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from awex_fast.meta import (
    MetadataError,
    ParameterMeta,
    ShardMeta,
    ShardRule,
    chunk_bounds,
    dtype_itemsize,
    dtype_name,
    merge_metas,
    metas_from_awex,
    metas_from_json,
    metas_to_json,
    transfer_ranks,
    validate_metas,
    with_rank_offset,
)

S, R = ShardMeta, ShardRule  # short names for the tables below


def raises_naming(*parts: str):
    """pytest.raises(MetadataError) whose message must contain every part, in order (the tables
    below write the parts as one string joined by "|")."""
    return pytest.raises(MetadataError, match=".*".join(re.escape(p) for p in parts))


# ---- construction --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "parts"),
    [
        (
            lambda: S(0, (0,), (2, 2)),
            "piece of rank 0|global_offset (0,) mismatches shape (2, 2)",
        ),
        (lambda: S(0, (0, 0), (2, -1)), "negative extent|(2, -1)"),
        (lambda: S(1.5, (0,), (2,)), "rank must be an integer"),
        (lambda: S(0, (0.5,), (2,)), "global_offset must be a sequence of integers"),
        (lambda: S(0, (0,), (2,), (0, 0)), "local_offset (0, 0) mismatches shape (2,)"),
        (lambda: R((0, 1), (0,), (2, 2)), "split_dims (0,) and num_chunks (2, 2)"),
        (lambda: R((0, 1, 2, 3), (0, 0), (2, 2)), "distinct"),
        (lambda: R((), (0,), (0,)), "must be >= 1"),
        (lambda: R((0,), (), (), replicas=0), "must be >= 1"),
        (lambda: R((0,), (), (), replicas="1"), "replicas must be an integer"),
        (
            lambda: ParameterMeta("w", (4,), "float32", rules=((0, 1),)),
            "'w'|rules[0] is tuple, not ShardRule",
        ),
        (lambda: R((0, 1, 2), (0,), (2,)), "lists 3 ranks|need 2"),
        (lambda: ParameterMeta("", (2,), "float32"), "non-empty string"),
        (lambda: ParameterMeta("w", (2, -3), "float32"), "'w'|negative extent"),
        (lambda: ParameterMeta("w", (2, "x"), "float32"), "'w'|global_shape must be"),
        (lambda: ParameterMeta("w", (4, 4), "float32", (S(0, (0,), (4,)),)), "'w'|1 dims"),
        (lambda: ParameterMeta("w", (4,), "float32", ((0, (0,), (4,)),)), "shards[0] is tuple"),
        (
            lambda: ParameterMeta("w", (4,), "float32", rules=(R((0, 1), (1,), (2,)),)),
            "splits dims",
        ),
        (
            lambda: ParameterMeta("w", (4,), "float32", rules=(R((0,), local_offset=(0, 0)),)),
            "rules[0] local_offset (0, 0) has 2 dims",
        ),
    ],
)
def test_construction_rejects(build, parts):
    with raises_naming(*parts.split("|")):
        build()


def test_construction_normalises():
    m = ParameterMeta("w", [4, 2], torch.half, [S(0, [0, 0], torch.Size([4, 2]))])
    assert m.dtype == "float16" and m.global_shape == (4, 2) and isinstance(m.shards, tuple)
    assert ParameterMeta("w", (1,), "torch.bfloat16").dtype == "bfloat16"
    assert ParameterMeta("w", (1,), "long").dtype == "int64"
    assert m.numel == 8 and m.itemsize == 2 and m.nbytes == 16
    assert S(0, (1, 2), (3, 4)).local == (0, 0) and S(0, (1, 2), (3, 4)).numel == 12
    assert S(0, (), ()).numel == 1


def test_dtype_table_matches_torch():
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert len(dtypes) > 20
    for d in dtypes:
        assert dtype_itemsize(d) == d.itemsize, d
        assert dtype_itemsize(dtype_name(d)) == d.itemsize, d
        assert getattr(torch, dtype_name(d)) == d
    assert dtype_itemsize("float8_e4m3fn") == 1 and dtype_itemsize("float8_e5m2") == 1
    with raises_naming("unknown dtype 'bf16'"):
        dtype_itemsize("bf16")
    with raises_naming("'w'", "unknown dtype 'bf16'"):
        _ = ParameterMeta("w", (2,), "bf16").nbytes


# ---- rule expansion against an independent torch.chunk oracle ------------------------------------


def oracle_pieces(full: torch.Tensor, rule: ShardRule) -> list[tuple[int, torch.Tensor]]:
    """(rank, sub-tensor) per piece: nested torch.chunk along the split dims, cells numbered
    row-major, a cell torch.chunk does not return (or returns empty) dropped."""
    cells: list[torch.Tensor | None] = [full]
    for dim, n in zip(rule.split_dims, rule.num_chunks, strict=True):
        nxt: list[torch.Tensor | None] = []
        for t in cells:
            parts = torch.chunk(t, n, dim=dim) if t is not None else ()
            nxt.extend(parts[i] if i < len(parts) else None for i in range(n))
        cells = nxt
    total = len(cells)
    out = []
    for c, t in enumerate(cells):
        if t is not None and t.numel() > 0:
            out.extend((rule.ranks[j * total + c], t) for j in range(rule.replicas))
    return out


def check_expansion(gshape: tuple[int, ...], rule: ShardRule) -> None:
    full = torch.arange(torch.Size(gshape).numel()).reshape(gshape)  # distinct values: a wrong box shows
    meta = ParameterMeta("w", gshape, "float32", rules=(rule,))
    got = list(rule.expand(gshape))
    want = oracle_pieces(full, rule)
    assert len(got) == len(want) == rule.num_pieces(gshape) == meta.num_pieces()
    for piece, (rank, sub) in zip(got, want, strict=True):
        assert piece.rank == rank
        view = full[tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.shape, strict=True))]
        assert view.shape == sub.shape and torch.equal(view, sub)
        assert piece.local_offset == rule.local_offset
    assert meta.ranks() == {p.rank for p in got}
    for r in set(rule.ranks):
        assert meta.pieces_for_rank(r) == [p for p in got if p.rank == r]
    cells = rule.nonempty_cells(gshape)
    assert len(cells) * rule.replicas == len(got)
    for c in cells:
        off, shp = rule.cell_box(gshape, c)
        assert 0 not in shp and any(p.global_offset == off and p.shape == shp for p in got)


@pytest.mark.parametrize(
    ("gshape", "rule"),
    [
        ((7, 3), R((0, 1, 2, 3), (0,), (4,))),  # uneven: 2, 2, 2, 1
        ((3, 5), R((5, 6, 7, 8), (0,), (4,))),  # 3 rows over 4: last chunk empty
        ((5,), R((0, 1, 2, 3), (0,), (4,))),  # 5 over 4: chunks 2, 2, 1, empty
        ((6, 10), R(tuple(range(12)), (1, 0), (3, 2), replicas=2)),  # dims out of order
        ((0, 4), R((0, 1), (0,), (2,))),  # empty tensor: no pieces
        ((4, 0), R((0, 1), (0,), (2,))),  # empty in a non-split dim
        ((), R((3, 4, 5), replicas=3)),  # 0-d scalar, replicated
        ((2, 3, 4), R(tuple(range(24)), (0, 1, 2), (2, 3, 4), local_offset=(1, 0, 0))),
    ],
)
def test_rule_expansion_matches_torch_chunk(gshape, rule):
    check_expansion(gshape, rule)


@st.composite
def shape_and_rule(draw):
    nd = draw(st.integers(0, 3))
    gshape = tuple(draw(st.lists(st.integers(0, 7), min_size=nd, max_size=nd)))
    dims = draw(st.permutations(range(nd)))[: draw(st.integers(0, nd))]
    chunks = tuple(draw(st.integers(1, 5)) for _ in dims)
    replicas = draw(st.integers(1, 3))
    n = torch.Size(chunks).numel() * replicas
    ranks = tuple(draw(st.permutations(range(n + 3)))[:n])
    return gshape, R(ranks, tuple(dims), chunks, replicas)


@settings(max_examples=80, deadline=None)
@given(shape_and_rule())
def test_rule_expansion_property(case):
    check_expansion(*case)


def test_chunk_bounds_matches_torch_chunk():
    for size, n in itertools.product(range(0, 12), range(1, 6)):
        parts = torch.chunk(torch.arange(size), n)
        for i in range(n):
            start, stop = chunk_bounds(size, n, i)
            if i < len(parts) and size:
                assert (start, stop - start) == (
                    int(parts[i][0]) if parts[i].numel() else start,
                    parts[i].numel(),
                )
            else:
                assert stop == start


# ---- JSON ----------------------------------------------------------------------------------------


def sample_metas() -> list[ParameterMeta]:
    tp = R(tuple(range(8)), (0,), (4,), replicas=2)
    return [
        ParameterMeta(
            "model.layers.0.self_attn.q_proj.weight",
            (16, 8),
            "bfloat16",
            (S(9, (0, 0), (8, 8)), S(9, (8, 0), (8, 8), (8, 0))),
            (tp,),
        ),
        ParameterMeta("model.layers.0.mlp.up_proj.weight", (32, 8), "float8_e4m3fn", rules=(tp,)),
        ParameterMeta("scalar", (), "float32", (S(0, (), ()), S(1, (), (), ()))),
        ParameterMeta("empty", (0, 4), "float16", (S(0, (0, 0), (0, 4)),), (R((0, 1), (0,), (2,)),)),
        ParameterMeta(
            "runs",
            (64,),
            "int64",
            rules=(R((*range(0, 16), *range(100, 116, 1)) * 2, (0,), (32,), 2),),
        ),
        ParameterMeta(
            "scrambled",
            (10, 2),
            "float32",
            rules=(R((7, 3, 9, 1, 4, 8, 2, 0, 6, 5), (0,), (10,), local_offset=(0, 2)),),
        ),
        ParameterMeta("ünïcode.weight", (3,), "bool"),
    ]


def test_json_round_trip_and_format():
    metas = sample_metas()
    data = metas_to_json(metas)
    assert isinstance(data, bytes)
    # "runs" lists its ranks twice per cell (rank 0 holds two replicas of cell 0): a codec case
    # that validation refuses.
    with pytest.raises(MetadataError, match="parameter 'runs': rank 0 holds overlapping pieces"):
        metas_from_json(data)
    back = metas_from_json(data, validate=False)
    assert back == metas
    assert metas_to_json(back) == data  # canonical: re-encoding gives the same bytes
    assert metas_from_json(data.decode(), validate=False) == metas
    assert metas_from_json(bytearray(data), validate=False) == metas
    assert metas_from_json(memoryview(data), validate=False) == metas
    doc = json.loads(data)
    assert doc["format"] == "awex_fast.metas" and doc["version"] == 1
    # equal rules are stored once and shared after decoding; ranges are [start, stop, step]
    assert doc["params"][0]["rules"] == doc["params"][1]["rules"] == [0]
    assert back[0].rules[0] is back[1].rules[0]
    assert doc["rules"][0][0] == [[0, 8, 1]]
    assert doc["rules"][2][0] == [[0, 16, 1], [100, 116, 1], [0, 16, 1], [100, 116, 1]]
    assert doc["rules"][3][0] == [7, 3, 9, 1, 4, 8, 2, 0, 6, 5]
    assert "shards" not in doc["params"][1] and "rules" not in doc["params"][2]
    assert doc["params"][2]["shards"] == [[0, [], []], [1, [], [], []]]
    assert metas_from_json(metas_to_json([])) == []


@st.composite
def param_metas(draw):
    nd = draw(st.integers(0, 3))
    gshape = tuple(draw(st.lists(st.integers(0, 9), min_size=nd, max_size=nd)))
    small = st.integers(0, 9)
    opt_vec = st.none() | st.lists(small, min_size=nd, max_size=nd).map(tuple)
    shards = draw(
        st.lists(
            st.builds(
                ShardMeta,
                st.integers(-3, 2000),
                st.lists(small, min_size=nd, max_size=nd),
                st.lists(small, min_size=nd, max_size=nd),
                opt_vec,
            ),
            max_size=4,
        )
    )
    rules = []
    for _ in range(draw(st.integers(0, 2))):
        dims = draw(st.permutations(range(nd)))[: draw(st.integers(0, nd))]
        chunks = [draw(st.integers(1, 4)) for _ in dims]
        replicas = draw(st.integers(1, 3))
        n = torch.Size(chunks).numel() * replicas
        style = draw(st.sampled_from(["range", "runs", "random"]))
        if style == "range":
            start, step = draw(st.integers(0, 500)), draw(st.sampled_from([1, 2, 7, -1]))
            ranks = [start + 500 + step * i for i in range(n)]
        elif style == "runs":
            ranks = list(itertools.islice(itertools.cycle(range(draw(st.integers(1, 6)))), n))
        else:
            ranks = draw(st.lists(st.integers(-5, 5000), min_size=n, max_size=n))
        rules.append(R(ranks, dims, chunks, replicas, draw(opt_vec)))
    name = draw(st.text(min_size=1, max_size=10))
    dtype = draw(st.sampled_from(["bfloat16", "float32", "float8_e5m2", "int64", "mystery"]))
    return ParameterMeta(name, gshape, dtype, shards, rules)


@settings(max_examples=60, deadline=None)
@given(st.lists(param_metas(), max_size=5))
def test_json_round_trip_property(metas):
    # The codec alone: arbitrary metadata, most of which validate_metas refuses.
    data = metas_to_json(metas)
    back = metas_from_json(data, validate=False)
    assert back == metas
    assert metas_to_json(back) == data


def _doc(**param_overrides) -> dict:
    param = {"name": "w", "shape": [4, 4], "dtype": "float32", "shards": [[2, [0, 0], [4, 4]]], "rules": [0]}
    param.update(param_overrides)
    return {"format": "awex_fast.metas", "version": 1, "rules": [[[0, 1], [0], [2], 1]], "params": [param]}


def _with(doc: dict, **top) -> dict:
    doc.update(top)
    return doc


def _without(d: dict, key: str) -> dict:
    d = dict(d)
    del d[key]
    return d


def _rule_doc(rule) -> dict:
    return _with(_doc(), rules=[rule])


BAD_JSON = [
    (b"\xff\xfe{}", "not valid UTF-8"),
    (b'{"format": ', "malformed"),
    (b"[" * 100_000, "malformed"),
    (b"[]", "must be an object"),
    (_with(_doc(), format="awex.metas"), "format tag is 'awex.metas'"),
    (_without(_doc(), "format"), "format tag is None"),
    (_with(_doc(), version=2), "version 2 is not supported|reads 1"),
    (_with(_doc(), version=True), "version True is not supported"),
    (_with(_doc(), version="1"), "version '1' is not supported"),
    (_without(_doc(), "version"), "version None"),
    (_with(_doc(), extra=1), "fields are|'extra'"),
    (_without(_doc(), "rules"), "fields are"),
    (_with(_doc(), params={}), "'params' must be lists"),
    (_with(_doc(), params=[3]), "params[0] must be an object"),
    (_with(_doc(), params=[_without(_doc()["params"][0], "name")]), "params[0] lacks the field 'name'"),
    (_with(_doc(), params=[_without(_doc()["params"][0], "shape")]), "lacks the field 'shape'"),
    (_with(_doc(), params=[_without(_doc()["params"][0], "dtype")]), "lacks the field 'dtype'"),
    (_doc(extra=True), "params[0] has unknown fields ['extra']"),
    (_doc(name=5), "params[0] name must be a non-empty string"),
    (_doc(name=""), "name must be a non-empty string"),
    (_doc(shape=[4, "4"]), "params[0] ('w') shape must be a list of integers"),
    (_doc(shape=[4, True]), "('w') shape must be a list of integers"),
    (_doc(shape=[4.0, 4]), "('w') shape must be a list of integers"),
    (_doc(shape=4), "('w') shape must be a list of integers"),
    (_doc(dtype=3), "('w') dtype must be a non-empty string"),
    (_doc(shards={}), "('w') shards must be a list"),
    (_doc(shards=[[0, [0, 0]]]), "('w') shards[0] must be [rank, offset, shape"),
    (_doc(shards=[["0", [0, 0], [4, 4]]]), "shards[0] must be [rank"),
    (_doc(shards=[[0, [0, 0], [4, None]]]), "('w') shards[0] shape must be a list of integers"),
    (_doc(shards=[[0, [0, 0], [4, 4], [0]]]), "shards[0]: piece of rank 0: local_offset (0,) mismatches"),
    (_doc(shards=[[0, [0], [4, 4]]]), "shards[0]: piece of rank 0: global_offset (0,)"),
    (_doc(shards=[[0, [0, 0], [4, -4]]]), "shards[0]: piece of rank 0: negative extent"),
    (_doc(shards=[[0, [0], [4]]]), "parameter 'w': shards[0] (rank 0) has 1 dims"),
    (_doc(rules=[1]), "('w') rules [1] index past the 1-entry rule table"),
    (_doc(rules=[-1]), "index past"),
    (_doc(rules=["0"]), "('w') rules must be a list of integers"),
    (_rule_doc([[0, 1], [0], [2]]), "rules[0] must be [ranks, split_dims"),
    (_rule_doc({"ranks": [0, 1]}), "rules[0] must be [ranks"),
    (_rule_doc([[0, 1, 2], [0], [2], 1]), "rules[0] ranks lists 3 ranks, the rule's grid needs 2"),
    (_rule_doc([[[0, 2, 0]], [0], [2], 1]), "rules[0] ranks: range [0, 2, 0]|step != 0"),
    (_rule_doc([[[0, 10**12, 1]], [0], [2], 1]), "rules[0] ranks lists more ranks"),
    (_rule_doc([[[0, 2]], [0], [2], 1]), "must be [start, stop, step]"),
    (_rule_doc([[0, "1"], [0], [2], 1]), "rules[0] ranks items must be ranks or"),
    (_rule_doc(["0-1", [0], [2], 1]), "rules[0] ranks must be a list"),
    (_rule_doc([[0, 1], [0], [0], 1]), "rules[0]: num_chunks (0,)|>= 1"),
    (_rule_doc([[0, 1], [0], [2], True]), "replicas True must be ints >= 1"),
    (_rule_doc([[0, 1], [0], [2], 1, [0.0, 0]]), "rules[0] local_offset must be a list of integers"),
    (_rule_doc([[0, 1], ["0"], [2], 1]), "rules[0] split_dims must be a list of integers"),
    (_rule_doc([[[0, 1 << 30, 1]], [0, 1], [1 << 15, 1 << 15], 1]), "exceeds the limit"),
    (_rule_doc([[0, 1, 2, 3], [0, 0], [2, 2], 1]), "rules[0]: rule split_dims (0, 0) must be distinct"),
    (_rule_doc([[0, 1], [2], [2], 1]), "parameter 'w': rules[0] splits dims (2,)"),
    # a range longer than sys.maxsize (len(range(...)) raised OverflowError)
    (_rule_doc([[[0, 1 << 63, 1]], [0], [2], 1]), "rules[0] ranks lists more ranks than the rule's grid"),
    (_rule_doc([[[1 << 62, -(1 << 62), -1]], [0], [2], 1]), "rules[0] ranks lists more ranks"),
    # well-formed JSON, metadata validate_metas refuses
    (_doc(shards=[[0, [0, 0], [4, 4]]]), "parameter 'w': rank 0 holds overlapping pieces in global space"),
    (_doc(shards=[[2, [0, 0], [4, 2]], [2, [0, 2], [4, 2]]], rules=[]), "rank 2 holds overlap|local space"),
    (_doc(shards=[[2, [1, 0], [4, 4]]]), "parameter 'w': shards[0] of rank 2, box [1:5, 0:4]: outside"),
    (_doc(dtype="float7"), "parameter 'w': unknown dtype 'float7'"),
    ({**_doc(), "params": [_doc()["params"][0], _doc(dtype="float16")["params"][0]]},
     "parameter 'w': rank 0 reports dtype 'float32' but rank 0 reports 'float16'"),
    ({**_doc(), "params": [_doc()["params"][0], _doc(shards=[[2, [0, 0], [2, 4]]], rules=[])["params"][0]]},
     "parameter 'w': rank 2 holds overlapping pieces in global space"),
    (
        b'{"format":"awex_fast.metas","version":1,"rules":[],"params":[{"name":"w","shape":[NaN],"dtype":"x"}]}',
        "shape must be a list of integers",
    ),
]


@pytest.mark.parametrize(("data", "parts"), BAD_JSON, ids=[str(i) for i in range(len(BAD_JSON))])
def test_json_rejects(data, parts):
    if isinstance(data, dict):
        data = json.dumps(data).encode()
    with raises_naming(*parts.split("|")):
        metas_from_json(data)


def test_json_valid_doc_helper_is_valid():
    # the template the rejection cases mutate must itself decode, or they prove nothing
    (m,) = metas_from_json(json.dumps(_doc()).encode())
    assert m.shards == (S(2, (0, 0), (4, 4)),) and m.rules == (R((0, 1), (0,), (2,)),)


def test_json_rejects_bad_arguments():
    with raises_naming("must be bytes or str"):
        metas_from_json(12)
    with raises_naming("metas[1] is dict, not ParameterMeta"):
        metas_to_json([sample_metas()[0], {"name": "w"}])


# ---- merge ---------------------------------------------------------------------------------------


def per_rank_layout() -> list[list[ParameterMeta]]:
    """8 ranks: rows of 'b' split over all, 'a' replicated on even ranks, each rank also
    reporting the shared TP rule of 'c' (so the rule arrives 8 times)."""
    c_rule = R(tuple(range(8)), (1,), (8,))
    lists = []
    for r in range(8):
        metas = [
            ParameterMeta("b", (16, 4), "bfloat16", (S(r, (2 * r, 0), (2, 4)),)),
            ParameterMeta("c", (3, 16), "float32", rules=(c_rule,)),
        ]
        if r % 2 == 0:
            metas.append(ParameterMeta("a", (5,), "float32", (S(r, (0,), (5,)),)))
        lists.append(metas)
    return lists


def test_merge_combines_sorts_and_dedupes():
    merged = merge_metas(per_rank_layout())
    assert [m.name for m in merged] == ["a", "b", "c"]
    assert [s.rank for s in merged[0].shards] == [0, 2, 4, 6]
    assert [s.global_offset for s in merged[1].shards] == [(2 * r, 0) for r in range(8)]
    assert len(merged[2].rules) == 1 and merged[2].shards == ()
    validate_metas(merged)


def test_merge_is_deterministic_under_shuffles():
    want = merge_metas(per_rank_layout())
    rng = random.Random(0)
    for _ in range(10):
        lists = per_rank_layout()
        extra = [ParameterMeta("b", (16, 4), "bfloat16", (S(1, (2, 0), (2, 4)), S(0, (0, 0), (2, 4))))]
        lists.append(extra)  # re-reports of pieces already there
        rng.shuffle(lists)
        for lst in lists:
            rng.shuffle(lst)
        got = merge_metas({i + 100: lst for i, lst in enumerate(lists)} if rng.random() < 0.5 else lists)
        assert got == want
        assert metas_to_json(got) == metas_to_json(want)


def test_merge_orders_shards_by_rank_offset_local():
    shards = [
        S(1, (4,), (2,), (2,)),
        S(1, (4,), (2,)),
        S(0, (6,), (2,)),
        S(1, (0,), (2,)),
    ]
    for perm in itertools.permutations(shards):
        (m,) = merge_metas([[ParameterMeta("w", (8,), "float32", perm)]])
        assert m.shards == (shards[2], shards[3], shards[1], shards[0])


def test_merge_conflicts_name_both_ranks_and_values():
    a = ParameterMeta("w", (4, 4), "float32", (S(3, (0, 0), (4, 4)),))
    b = ParameterMeta("w", (4, 8), "float32", (S(7, (0, 0), (4, 8)),))
    with raises_naming("'w'", "rank 3", "(4, 4)", "rank 7", "(4, 8)"):
        merge_metas({3: [a], 7: [b]})
    with raises_naming("'w'", "rank 0", "(4, 4)", "rank 1", "(4, 8)"):
        merge_metas([[a], [b]])
    c = ParameterMeta("w", (4, 4), "bfloat16")
    with raises_naming("'w'", "rank 0", "dtype 'float32'", "rank 2", "'bfloat16'"):
        merge_metas([[a], [], [c]])
    with raises_naming("rank 1 reported str"):
        merge_metas([[a], ["w"]])


# ---- validation ----------------------------------------------------------------------------------


def P(shards=(), rules=(), shape=(8, 4), name="w", dtype="float32"):
    return ParameterMeta(name, shape, dtype, tuple(shards), tuple(rules))


def test_validate_accepts_valid_layouts():
    validate_metas(
        [
            P([S(0, (0, 0), (8, 4)), S(1, (0, 0), (8, 4))]),  # replicas on two ranks
            P(
                [S(0, (0, 0), (2, 4)), S(0, (4, 0), (2, 4), (2, 0))], name="interleaved"
            ),  # one rank, two pieces
            P(rules=[R((0, 1, 2, 0), (0,), (4,))], shape=(3, 4), name="dup_on_empty"),  # 2nd 0 holds nothing
            P([S(0, (0, 0), (0, 4)), S(0, (0, 0), (0, 4))], shape=(0, 4), name="empty"),
            P([S(r, (), ()) for r in range(3)], shape=(), name="scalar"),
            P([S(5, (0, 0), (4, 4))], [R((0, 1), (0,), (2,))], name="rule_and_other_rank"),
            P(
                [S(0, (0, 0), (4, 4)), S(0, (4, 0), (4, 4), (4, 0))],
                [R((1, 2), (0,), (2,))],
                name="mix",
            ),
            P(
                rules=[R((0, 1), (0,), (2,)), R((1, 0), (0,), (2,), local_offset=(4, 0))],
                name="2rules",
            ),
        ]
    )


BAD_LAYOUTS = [
    (P([S(-1, (0, 0), (8, 4))]), "'w'|shards[0] of rank -1, box [0:8, 0:4]: negative rank"),
    (
        P(rules=[R((0, -2), (0,), (2,))]),
        "'w'|rules[0] cell 1 replica 0 has negative rank -2|[4:8, 0:4]",
    ),
    (P([S(0, (-1, 0), (2, 4))]), "'w'|shards[0] of rank 0, box [-1:1, 0:4]: outside global_shape (8, 4)"),
    (P([S(2, (0, 2), (8, 4))]), "'w'|shards[0] of rank 2, box [0:8, 2:6]: outside global_shape (8, 4)"),
    (
        P([S(2, (0, 0), (8, 4), (0, -1))]),
        "shards[0] of rank 2, box [0:8, 0:4]: negative local_offset (0, -1)",
    ),
    (P(rules=[R((0, 1), (0,), (2,), local_offset=(-1, 0))]), "rules[0] has negative local_offset"),
    (
        P([S(0, (0, 0), (8, 4)), S(1, (0, 0), (4, 4)), S(1, (2, 0), (4, 4), (4, 0))]),
        "'w'|rank 1|global space|shards[1] box [0:4, 0:4]|shards[2] box [2:6, 0:4]",
    ),
    (
        P([S(3, (0, 0), (4, 4)), S(3, (4, 0), (4, 4), (2, 0))]),
        "'w'|rank 3|local space|shards[0] box [0:4, 0:4]|shards[1] box [2:6, 0:4]",
    ),
    (
        P(rules=[R((0, 1, 0, 2), (0,), (2,), replicas=2)]),  # rank 0: cell 0 in both replicas
        "'w'|rank 0|global space|rules[0] cell 0 replica 0 box [0:4, 0:4]|cell 0 replica 1",
    ),
    (
        P(rules=[R((4, 4), (0,), (2,))]),  # rank 4: both cells at local offset 0
        "'w'|rank 4|local space|rules[0] cell 0 replica 0 box [0:4, 0:4]|cell 1 replica 0 box [0:4, 0:4]",
    ),
    (
        P([S(1, (6, 0), (2, 4), (4, 0))], [R((0, 1), (0,), (2,))]),
        "'w'|rank 1|global space|rules[0] cell 1 replica 0 box [4:8, 0:4]|shards[0] box [6:8, 0:4]",
    ),
    (
        P([S(1, (0, 0), (2, 4))], [R((0, 1), (0,), (2,))]),  # disjoint globally, same local 0
        "'w'|rank 1|local space|shards[0] box [0:2, 0:4]|rules[0] cell 1 replica 0 box [0:4, 0:4]",
    ),
    (
        P(rules=[R((0, 1), (0,), (2,)), R((0, 1), (1,), (2,), local_offset=(4, 0))]),
        "'w'|rank 0|global space|rules[0] cell 0|rules[1] cell 0",
    ),
    (P([S(0, (), ()), S(0, (), (), ())], shape=()), "'w'|rank 0|global space|box []"),
    (P(dtype="bf16"), "'w'|unknown dtype 'bf16'"),
]


@pytest.mark.parametrize(("meta", "parts"), BAD_LAYOUTS, ids=[str(i) for i in range(len(BAD_LAYOUTS))])
def test_validate_names_each_defect(meta, parts):
    with raises_naming(*parts.split("|")):
        validate_metas([P([S(0, (0, 0), (8, 4))], name="fine"), meta])


def test_validate_rejects_duplicates_and_non_metas():
    with raises_naming("'w' appears more than once", "metas[1]"):
        validate_metas([P(), P()])
    with raises_naming("metas[0] is str"):
        validate_metas(["w"])


def brute_overlap(boxes) -> bool:
    def hit(a, b):
        return all(x < y + m and y < x + n for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True))

    live = [b for b in boxes if 0 not in b[1]]
    return any(hit(a, b) for a, b in itertools.combinations(live, 2))


@st.composite
def one_rank_pieces(draw):
    nd = draw(st.integers(1, 3))
    gshape = tuple(draw(st.lists(st.integers(1, 6), min_size=nd, max_size=nd)))
    shards = []
    for _ in range(draw(st.integers(1, 8))):
        off = [draw(st.integers(0, g - 1)) for g in gshape]
        shape = [draw(st.integers(0, g - o)) for g, o in zip(gshape, off, strict=True)]
        local = [draw(st.integers(0, 8)) for _ in gshape]
        shards.append(S(0, off, shape, local))
    return gshape, shards


@settings(max_examples=150, deadline=None)
@given(one_rank_pieces())
def test_validate_sweep_agrees_with_brute_force(case):
    gshape, shards = case
    overlap = brute_overlap([(s.global_offset, s.shape) for s in shards]) or brute_overlap(
        [(s.local, s.shape) for s in shards]
    )
    meta = P(shards, shape=gshape)
    if overlap:
        with raises_naming("rank 0 holds overlapping pieces"):
            validate_metas([meta])
    else:
        validate_metas([meta])


def test_validate_scales_to_10k_pieces():
    n = 10_000
    one_rank = P([S(0, (i, 0), (1, 4), (n - 1 - i, 0)) for i in range(n)], shape=(n, 4), name="rows")
    cols = P([S(0, (0, i), (4, 1), (0, i)) for i in range(n)], shape=(4, n), name="cols")
    many = P([S(i, (i, 0), (1, 4)) for i in range(n)], shape=(n, 4), name="many_ranks")
    mixed = P(  # rank i: row i by the rule (local row 0), row i+1 explicitly (local row 1)
        [S(i, ((i + 1) % n, 0), (1, 4), (1, 0)) for i in range(n)],
        [R(tuple(range(n)), (0,), (n,))],
        shape=(n, 4),
        name="rule_plus_explicit",
    )
    t0 = time.process_time()
    validate_metas([one_rank, cols, many, mixed])
    elapsed = time.process_time() - t0
    print(f"validate 4 params x 10k pieces: {elapsed:.3f} CPU s")
    assert elapsed < 10  # O(n log n); an all-pairs check would be ~2e8 box tests
    bad = P([*mixed.shards, S(n - 1, (5, 0), (1, 4), (1, 0))], mixed.rules, shape=(n, 4), name="bad")
    with raises_naming("'bad'", f"rank {n - 1}", "local space"):
        validate_metas([bad])


# ---- rank spaces ---------------------------------------------------------------------------------


def test_transfer_ranks_unequal_engines():
    bases, train_base = transfer_ranks([4, 8, 2], 16)
    assert bases == [0, 4, 12] and train_base == 14
    assert transfer_ranks([], 2) == ([], 0)
    engines = [
        [P([S(r, (2 * r, 0), (2, 4))], name="w") for r in range(4)],
        [P([S(r, (r, 0), (1, 4))], name="w") for r in range(8)],
        [P([S(r, (4 * r, 0), (4, 4))], name="w") for r in range(2)],
    ]
    train = [P([S(r, (r // 2, 0), (1, 4))], name="w") for r in range(16)]
    placed = [with_rank_offset(metas, bases[e]) for e, metas in enumerate(engines)]
    placed.append(with_rank_offset(train, train_base))
    merged = merge_metas(placed)
    ranks = sorted(s.rank for s in merged[0].shards)
    assert ranks == list(range(14 + 16))
    assert merged[0].pieces_for_rank(4 + 3) == [S(7, (3, 0), (1, 4))]  # engine 1, local rank 3
    assert merged[0].pieces_for_rank(14 + 5) == [S(19, (2, 0), (1, 4))]  # training rank 5
    assert transfer_ranks([np.int64(3), 5], np.int32(2)) == ([0, 3], 8)
    for bad in ([4, 0], [4, -1], [True], [2.0], ["4"]):
        with raises_naming("size must be a positive integer"):
            transfer_ranks(bad, 4)
    with raises_naming("train_world_size"):
        transfer_ranks([4], 0)


def test_with_rank_offset_shifts_shards_and_rules():
    rule = R(tuple(range(4)), (0,), (2,), replicas=2, local_offset=(0, 1))
    metas = [P([S(1, (0, 0), (8, 4), (1, 1))], [rule]), P(rules=[rule], name="v")]
    moved = with_rank_offset(metas, 10)
    assert moved[0].shards == (S(11, (0, 0), (8, 4), (1, 1)),)
    assert moved[0].rules == (R((10, 11, 12, 13), (0,), (2,), 2, (0, 1)),)
    assert moved[0].rules[0] is moved[1].rules[0]
    assert {p.rank for p in moved[0].pieces()} == {p.rank + 10 for p in metas[0].pieces()}
    assert with_rank_offset(moved, -10) == metas
    assert with_rank_offset(metas, 0) == metas
    with raises_naming("'w'", "offset -2 gives rank -2"):
        with_rank_offset(metas, -2)
    with raises_naming("'w'", "offset -2 gives negative rank -1"):
        with_rank_offset([P([S(1, (0, 0), (8, 4))])], -2)
    with raises_naming("rank offset must be an integer"):
        with_rank_offset(metas, 1.0)


# ---- Awex conversion (classes mirroring awex.meta.weight_meta field names; awex is not installed) ----


@dataclass
class AwexShard:
    tp_rank: int
    attn_tp_rank: int
    pp_rank: int
    ep_rank: int
    ep_tp_rank: int
    global_rank: int
    world_size: int
    engine_rank: int
    name: str
    shape: tuple
    numel: int
    dtype: torch.dtype
    global_offset: tuple = field(default_factory=tuple)
    sharding_type: str = "TP_SHARDING"
    num_shards: int = 1
    sharding_dim: int = 0


@dataclass
class AwexReplica:
    shards: list


@dataclass
class AwexParam:
    name: str
    global_numel: int
    global_shape: tuple
    dtype: torch.dtype
    shards: list
    replicas: list


def awex_param(name="model.layers.0.mlp.down_proj.weight") -> AwexParam:
    shards = [
        AwexShard(
            tp,
            tp,
            0,
            0,
            0,
            dp * 2 + tp,
            4,
            dp,
            name,
            torch.Size([6, 4]),
            24,
            torch.bfloat16,
            (0, 4 * tp),
            num_shards=2,
            sharding_dim=1,
        )
        for dp in range(2)
        for tp in range(2)
    ]
    return AwexParam(
        name,
        48,
        torch.Size([6, 8]),
        torch.bfloat16,
        shards,
        [AwexReplica(shards[:2]), AwexReplica(shards[2:])],
    )


def test_metas_from_awex():
    (m,) = metas_from_awex([awex_param()], rank_offset=8)
    assert m.name == "model.layers.0.mlp.down_proj.weight" and m.dtype == "bfloat16"
    assert m.global_shape == (6, 8)
    assert m.shards == tuple(S(8 + dp * 2 + tp, (0, 4 * tp), (6, 4)) for dp in range(2) for tp in range(2))
    validate_metas([m])
    (plain,) = metas_from_awex([awex_param()])
    assert [s.rank for s in plain.shards] == [0, 1, 2, 3]
    unresolved = awex_param("b")
    unresolved.shards = [AwexShard(0, 0, 0, 0, 0, 5, 1, 0, "b", (6, 8), 48, torch.float32)]
    unresolved.dtype = torch.float32
    (u,) = metas_from_awex([unresolved])
    assert u.shards == (S(5, (0, 0), (6, 8)),) and u.dtype == "float32"
    assert metas_to_json(metas_from_json(metas_to_json([m, u]))) == metas_to_json([m, u])


def test_metas_from_awex_rejects_incomplete_objects():
    p = awex_param()
    del p.shards
    with raises_naming("awex meta 0", "lacks the attribute 'shards'"):
        metas_from_awex([p])

    @dataclass
    class NoRank:
        global_offset: tuple
        shape: tuple

    q = awex_param()
    q.shards = [NoRank((0, 0), (6, 8))]
    with raises_naming("awex meta 0", "shards[0] lacks 'global_rank'"):
        metas_from_awex([q])
    r = awex_param()
    r.global_shape = None
    with raises_naming("awex meta 0 ('model.layers.0.mlp.down_proj.weight')"):
        metas_from_awex([r])
    s = awex_param()
    s.shards[1].global_offset = (0,)
    with raises_naming("awex meta 0", "shards[1]: piece of rank 1: global_offset (0,) mismatches"):
        metas_from_awex([s])


# ---- Kimi-K2-sized layout: 61 layers x 384 experts x 3 matrices, 128 inference pieces each -------


KIMI_TENSORS = 61 * 384 * 3  # 70,272


def kimi_layout(scrambled: bool, count: int = KIMI_TENSORS) -> list[ParameterMeta]:
    """Inference side: 8 engines x TP16 (ranks 0..127), each expert matrix split 16 ways along
    its TP dim and replicated per engine. ``scrambled`` (the worst case): every tensor over its
    own list of 128 of 1,024 ranks in random order, so nothing compresses or is shared."""
    rng = random.Random(0)
    base = list(range(1024))
    rng.shuffle(base)
    pool = [tuple(base[k : k + 128]) for k in range(896)]  # rotations of these make 70k lists
    rules = {}
    out = []
    for i in range(count):
        layer, expert, mat = i // 1152, (i // 3) % 384, i % 3
        dim = 1 if mat == 2 else 0
        ranks = tuple(range(128))
        if scrambled:
            ranks, turn = pool[i % 896], i // 896
            ranks = ranks[turn:] + ranks[:turn]
        key = (ranks, dim)
        if key not in rules:
            rules[key] = R(ranks, (dim,), (16,), replicas=8)
        shape = (7168, 2048) if mat == 2 else (2048, 7168)
        name = f"model.layers.{layer}.mlp.experts.{expert}.{('gate', 'up', 'down')[mat]}_proj.weight"
        out.append(ParameterMeta(name, shape, "bfloat16", rules=(rules[key],)))
    return out


def timed_round_trip(metas: list[ParameterMeta]) -> tuple[bytes, list[float]]:
    clock = time.process_time  # CPU seconds: CI machines are shared, wall time is noise
    t0 = clock()
    data = metas_to_json(metas)
    t1 = clock()
    back = metas_from_json(data)
    t2 = clock()
    validate_metas(back)
    t3 = clock()
    assert back == metas
    return data, [t1 - t0, t2 - t1, t3 - t2]


def test_kimi_sized_layout_fits_and_is_fast():
    metas = kimi_layout(scrambled=False)
    assert len(metas) == 70_272 and sum(m.num_pieces() for m in metas) == 70_272 * 128
    data, (enc, dec, val) = timed_round_trip(metas)
    mib = len(data) / 2**20
    print(f"kimi layout: {mib:.2f} MiB; encode {enc:.3f} s, decode {dec:.3f} s, validate {val:.3f} s (CPU)")
    assert len(data) < 64 << 20
    assert len(json.loads(data)["rules"]) == 2  # one shared rule per split dim
    # generous bounds for a loaded 2-core CI machine; each measured 0.07-0.45 CPU s there
    assert enc < 3 and dec < 3 and val < 3


def test_kimi_sized_worst_case_rank_lists_fit():
    """Every tensor with its own irregular rank list (nothing to share or compress): an eighth
    of the layout, whose size times 8 bounds the whole (every tensor encodes to the same size
    give or take the digits of its name and ranks)."""
    part = KIMI_TENSORS // 8
    metas = kimi_layout(scrambled=True, count=part)
    data, (enc, dec, val) = timed_round_trip(metas)
    full = len(data) * KIMI_TENSORS / part / 2**20
    print(
        f"worst case 1/8: {len(data) / 2**20:.2f} MiB -> {full:.1f} MiB in full; encode {enc:.3f} s, "
        f"decode {dec:.3f} s, validate {val:.3f} s (CPU)"
    )
    assert len(json.loads(data)["rules"]) == part
    assert full < 64
    assert enc < 3 and dec < 3 and val < 3
