"""Megatron-style rule builders against an independent construction.

For each layout the test decodes every rank into its Megatron coordinates (its own mixed-radix
decoder over the order string), slices each global tensor the way Megatron holds it on that rank
(torch.chunk of the TP dim, the vocabulary padded to 128 x TP, expert blocks over EP, the
interleaved ``linear_qkv``), and compares that with what the metas' pieces (rules expanded
through ``ParameterMeta.pieces()``) say the rank holds, placed at their local offsets.
"""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from awex_fast.layouts.megatron import ParallelLayout, megatron_metas, megatron_style, world_ranks
from awex_fast.meta import metas_from_json, metas_to_json, validate_metas

H, I_DENSE, I_MOE, V, E = 8, 12, 8, 300, 8  # V=300: padded to 512 at TP2, rank 1 holds 44 rows
HEADS, GROUPS, HD = 4, 2, 2


def _names(num_layers=4, moe_layers=(1, 3), stacked=False, shared=True, tied=False):
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (H,)),
            (f"{p}.self_attn.q_proj.weight", (HEADS * HD, H)),
            (f"{p}.self_attn.q_proj.bias", (HEADS * HD,)),
            (f"{p}.self_attn.k_proj.weight", (GROUPS * HD, H)),
            (f"{p}.self_attn.k_proj.bias", (GROUPS * HD,)),
            (f"{p}.self_attn.v_proj.weight", (GROUPS * HD, H)),
            (f"{p}.self_attn.v_proj.bias", (GROUPS * HD,)),
            (f"{p}.self_attn.o_proj.weight", (H, HEADS * HD)),
            (f"{p}.post_attention_layernorm.weight", (H,)),
        ]
        if i in moe_layers:
            out.append((f"{p}.mlp.gate.weight", (E, H)))
            if stacked:
                out += [
                    (f"{p}.mlp.experts.gate_up_proj", (E, 2 * I_MOE, H)),
                    (f"{p}.mlp.experts.down_proj", (E, H, I_MOE)),
                ]
            else:
                for e in range(E):
                    q = f"{p}.mlp.experts.{e}"
                    out += [
                        (f"{q}.gate_proj.weight", (I_MOE, H)),
                        (f"{q}.up_proj.weight", (I_MOE, H)),
                        (f"{q}.down_proj.weight", (H, I_MOE)),
                    ]
            if shared:
                out += [
                    (f"{p}.mlp.shared_experts.gate_proj.weight", (I_DENSE, H)),
                    (f"{p}.mlp.shared_experts.up_proj.weight", (I_DENSE, H)),
                    (f"{p}.mlp.shared_experts.down_proj.weight", (H, I_DENSE)),
                ]
        else:
            out += [
                (f"{p}.mlp.gate_proj.weight", (I_DENSE, H)),
                (f"{p}.mlp.up_proj.weight", (I_DENSE, H)),
                (f"{p}.mlp.down_proj.weight", (H, I_DENSE)),
            ]
    out.append(("model.norm.weight", (H,)))
    if not tied:
        out.append(("lm_head.weight", (V, H)))
    return out


# ---- the independent side -----------------------------------------------------------------------
def _decode(rank, sizes, order):
    """Megatron's RankGenerator numbering: first name of ``order`` fastest."""
    names = order.split("-") + [k for k in ("tp", "cp", "ep", "dp", "pp") if k not in order.split("-")]
    coord = {}
    for key in names:
        rank, coord[key] = divmod(rank, sizes[key])
    assert rank == 0
    return coord


def _stage_of(layer, num_layers, pp):
    return layer // (num_layers // pp)


def _expected_local(name, full, rank, lay, num_layers, tied=False):
    """What Megatron's rank holds of canonical ``name``, as a tensor, or None."""
    dense = _decode(rank, {"tp": lay.tp, "cp": lay.cp, "ep": 1, "dp": lay.dp, "pp": lay.pp}, lay.order)
    etp = lay.etp or lay.tp
    edp = lay.tp * lay.cp * lay.dp // (etp * lay.ep)
    expert = _decode(rank, {"tp": etp, "cp": 1, "ep": lay.ep, "dp": edp, "pp": lay.pp}, lay.order)
    t, s = dense["tp"], dense["pp"]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        stages = {0} if name.startswith("model.") else {lay.pp - 1}
        if tied and name.startswith("model."):
            stages.add(lay.pp - 1)
        if s not in stages:
            return None
        per = math.ceil(V / (128 * lay.tp)) * 128  # rows per TP rank: vocab padded to 128 x TP
        rows = full[t * per : (t + 1) * per]
        return rows if rows.shape[0] else None
    if name == "model.norm.weight":
        return full if s == lay.pp - 1 else None
    layer = int(name.split(".")[2])
    if _stage_of(layer, num_layers, lay.pp) != s:
        return None
    rest = name.split(".", 3)[3]
    if ".experts." in rest:
        e_rank, et = expert["ep"], expert["tp"]
        if rest.endswith("gate_up_proj"):  # stacked: [gate_r | up_r] per local expert
            block = full[e_rank * (E // lay.ep) : (e_rank + 1) * (E // lay.ep)]
            gate, up = block[:, :I_MOE], block[:, I_MOE:]
            return torch.cat([gate.chunk(etp, dim=1)[et], up.chunk(etp, dim=1)[et]], dim=1)
        if rest.endswith("experts.down_proj"):
            block = full[e_rank * (E // lay.ep) : (e_rank + 1) * (E // lay.ep)]
            return block.chunk(etp, dim=2)[et]
        e = int(rest.split(".")[2])
        if e // (E // lay.ep) != e_rank:
            return None
        return full.chunk(etp, dim=1 if "down_proj" in rest else 0)[et]
    if rest.endswith(("layernorm.weight", "mlp.gate.weight")):
        return full
    if "o_proj" in rest or "down_proj" in rest:
        return full.chunk(lay.tp, dim=1)[t]
    return full.chunk(lay.tp, dim=0)[t]


def _linear_qkv(globals_, layer, lay, t, kind):
    """Megatron's local linear_qkv (weight or bias) of TP rank t: per local group [q_g | k_g | v_g]."""
    p = f"model.layers.{layer}.self_attn"
    q, k, v = (globals_[f"{p}.{x}_proj.{kind}"] for x in "qkv")
    qpg = HEADS // GROUPS
    parts = []
    for g in range(t * GROUPS // lay.tp, (t + 1) * GROUPS // lay.tp):
        parts += [q[g * qpg * HD : (g + 1) * qpg * HD], k[g * HD : (g + 1) * HD], v[g * HD : (g + 1) * HD]]
    return torch.cat(parts)


def _box(offset, shape):
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _check(lay, names, *, tied=False, interleaved=False):
    gen = torch.Generator().manual_seed(0)
    globals_ = {n: torch.randint(1, 1 << 20, s, generator=gen).float() for n, s in names}
    num_layers = 1 + max(int(n.split(".")[2]) for n, _ in names if n.startswith("model.layers."))
    metas = megatron_metas(
        names,
        lay,
        tie_word_embeddings=tied,
        interleaved_qkv=(HEADS, GROUPS, HD) if interleaved else None,
    )
    assert [m.name for m in metas] == [n for n, _ in names]
    validate_metas(metas)
    assert metas_from_json(metas_to_json(metas)) == metas
    by_rank = {r: {} for r in range(lay.world_size)}
    for m in metas:
        for piece in m.pieces():
            by_rank[piece.rank].setdefault(m.name, []).append(piece)
    for rank in range(lay.world_size):
        for m in metas:
            pieces = by_rank[rank].get(m.name, [])
            name = m.name
            is_qkv = (
                interleaved
                and ".self_attn." in name
                and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")
            )
            if is_qkv:
                dense = _decode(
                    rank, {"tp": lay.tp, "cp": lay.cp, "ep": 1, "dp": lay.dp, "pp": lay.pp}, lay.order
                )
                layer = int(name.split(".")[2])
                if _stage_of(layer, num_layers, lay.pp) != dense["pp"]:
                    assert not pieces, (rank, name)
                    continue
                local = _linear_qkv(globals_, layer, lay, dense["tp"], name.split(".")[-1])
                covered = 0
                for p in pieces:
                    assert torch.equal(
                        local[_box(p.local, p.shape)], globals_[name][_box(p.global_offset, p.shape)]
                    )
                    covered += p.numel
                assert covered == globals_[name].numel() // lay.tp, (rank, name)
                continue
            want = _expected_local(name, globals_[name], rank, lay, num_layers, tied=tied)
            if want is None:
                assert not pieces, f"rank {rank} should hold nothing of {name}, got {pieces}"
                continue
            got = torch.full(want.shape, -1.0)
            for p in pieces:
                got[_box(p.local, p.shape)] = globals_[name][_box(p.global_offset, p.shape)]
            assert torch.equal(got, want), f"rank {rank}: {name} differs from Megatron's local tensor"
    return metas


LAYOUTS = [
    ParallelLayout(tp=2, pp=2, dp=2),
    ParallelLayout(tp=2, cp=2, dp=1, pp=2),
    ParallelLayout(tp=1, dp=4, ep=4, pp=2),  # EP carved out of DP, as Megatron does
    ParallelLayout(tp=2, dp=2, ep=2, etp=1, pp=1),
    ParallelLayout(tp=2, dp=2, ep=2, etp=2, pp=2),
    ParallelLayout(tp=2, pp=2, dp=2, order="tp-pp-dp"),
    ParallelLayout(tp=2, dp=2, ep=4, etp=1, pp=1, order="tp-dp-ep-pp-cp"),
]


@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_rules_match_megatron(lay):
    _check(lay, _names())


@pytest.mark.parametrize("lay", LAYOUTS[2:5], ids=str)
def test_stacked_experts(lay):
    _check(lay, _names(stacked=True))


@pytest.mark.parametrize("lay", [ParallelLayout(tp=2, pp=2, dp=2), ParallelLayout(tp=1, pp=1, dp=2)], ids=str)
def test_interleaved_qkv(lay):
    """Canonical q/k/v as pieces of Megatron's per-group interleaved linear_qkv (local_offset)."""
    _check(lay, _names(), interleaved=True)


def test_tied_embeddings_on_first_and_last_stage():
    lay = ParallelLayout(tp=2, pp=2, dp=1)
    metas = _check(lay, _names(tied=True), tied=True)
    embed = next(m for m in metas if m.name == "model.embed_tokens.weight")
    assert sorted({p.rank for p in embed.pieces()}) == [0, 1, 2, 3]


def test_megatron_docstring_example():
    """Megatron-core's initialize_model_parallel example: 16 GPUs, TP 2, PP 4 (so DP 2)."""
    lay = ParallelLayout(tp=2, pp=4, dp=2)
    assert [lay.rank(tp=t, dp=0, pp=0) for t in range(2)] == [0, 1]  # tensor group [g0, g1]
    assert [lay.rank(tp=0, dp=d, pp=0) for d in range(2)] == [0, 2]  # data group [g0, g2]
    assert [lay.rank(tp=0, dp=0, pp=p) for p in range(4)] == [0, 4, 8, 12]  # pipeline group
    assert lay.stage_ranks(1) == [4, 5, 6, 7]
    # EP carved out of DP: TP 2 x DP 4, EP 4, ETP 1 -> EDP 2, expert grid etp-ep-edp-pp.
    moe = ParallelLayout(tp=2, dp=4, ep=4, etp=1)
    assert moe.expert_dp == 2
    assert [moe.expert_rank(ep=e) for e in range(4)] == [0, 1, 2, 3]
    assert [moe.expert_rank(edp=j) for j in range(2)] == [0, 4]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 2),
    st.permutations(["tp", "cp", "ep", "dp", "pp"]),
)
def test_rank_order_is_a_bijection(tp, pp, dp, cp, order):
    lay = ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp, order="-".join(order))
    assert world_ranks(lay) == list(range(lay.world_size))
    expert = sorted(
        lay.expert_rank(etp=t, ep=0, edp=j, pp=p)
        for t, j, p in itertools.product(range(lay.expert_tp), range(lay.expert_dp), range(pp))
    )
    assert expert == list(range(lay.world_size))


def test_pipeline_stages():
    assert ParallelLayout(pp=4).layer_stages(8) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ParallelLayout(pp=4, first_stage_layers=1, last_stage_layers=1).layer_stages(8) == [
        0,
        1,
        1,
        1,
        2,
        2,
        2,
        3,
    ]
    assert ParallelLayout(pp=2, vpp=2).layer_stages(8) == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="num_layers=7 cannot be split over pp=2"):
        ParallelLayout(pp=2).layer_stages(7)


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight'.*size 12 .* tp=5"):
        megatron_metas([("model.layers.0.mlp.gate_proj.weight", (12, 8))], ParallelLayout(tp=5))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.foo\.weight' has no Megatron placement rule"):
        megatron_metas([("model.layers.0.foo.weight", (2,))], ParallelLayout())
    with pytest.raises(ValueError, match="omits dp"):
        ParallelLayout(dp=2, order="tp-pp")
    with pytest.raises(ValueError, match="ETP x EP = 2 x 4 must divide"):
        ParallelLayout(tp=2, dp=2, ep=4, etp=2)
    # An override places a name the rules do not know.
    (meta,) = megatron_metas(
        [("model.layers.0.foo.weight", (4, 2))],
        ParallelLayout(tp=2),
        styles={"model.layers.0.foo.weight": "column"},
    )
    assert [p.shape for p in meta.pieces()] == [(2, 2), (2, 2)]
    assert megatron_style("model.layers.3.mlp.experts.17.down_proj.weight") == ("expert_row", 3, 17)


def _kimi_names():
    """Kimi-K2 / DeepSeek-V3-sized expert layout: 61 layers x 384 experts x 3 matrices."""
    h, i, e, v = 7168, 2048, 384, 163840
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(61):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (8192, h)),
            (f"{p}.self_attn.o_proj.weight", (h, 8192)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate.weight", (e, h)),
        ]
        out += [
            (f"{p}.mlp.experts.{x}.{m}.weight", (h, i) if m == "down_proj" else (i, h))
            for x in range(e)
            for m in ("gate_proj", "up_proj", "down_proj")
        ]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def test_kimi_sized_layout_builds_fast():
    """70k tensors, 256 ranks (EP64 x PP4). Measured about 0.5 s on the shared 2-core CI machine;
    the bound leaves room for a loaded machine."""
    names = _kimi_names()
    assert len(names) > 70_000
    lay = ParallelLayout(tp=1, dp=64, ep=64, pp=4, first_stage_layers=16, last_stage_layers=15)
    start = time.perf_counter()
    metas = megatron_metas(names, lay)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"building {len(names)} metas took {elapsed:.2f} s"
    assert len({id(r) for m in metas for r in m.rules}) < 1_000  # one rule object per placement
    expert = next(m for m in metas if m.name == "model.layers.20.mlp.experts.300.up_proj.weight")
    # Stage 1 holds layers 16..30; expert 300 is on EP rank 300 // 6 = 50, replicated over EDP 1.
    assert [p.rank for p in expert.pieces()] == [lay.expert_rank(ep=50, pp=1)]
