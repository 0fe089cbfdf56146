"""FusedLayout against an independent construction of vLLM's fused tensors.

The canonical tensors come from real transformers models (names and shapes as Hugging Face
defines them, values replaced by integers so a sentinel can never collide). The reference fused
tensors of each TP rank are built here the way vLLM's weight loaders fill them (QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, FusedMoE), written
without the layout's code. Then, for TP = 1, 2, 4, 8 with 2 KV heads:

* writing every meta piece, sliced out of the global tensors, into the canonical views of a
  sentinel-filled fused set reproduces the reference bit-exactly (so the views share storage and
  together cover every non-padding element);
* the views of the reference equal the global slices the metas name;
* over all ranks the pieces cover each global tensor with the expected multiplicity.
"""

from __future__ import annotations

import pytest
import torch

from awex_fast.layouts import DecoderConfig, FusedLayout, pad_vocab_size
from awex_fast.meta import merge_metas, validate_metas

SENTINEL = -1.0
TPS = (1, 2, 4, 8)


def _hf_model(kind: str, tied: bool = False):
    import transformers as tf

    common = dict(num_attention_heads=8, num_key_value_heads=2, vocab_size=100, tie_word_embeddings=tied)
    if kind == "qwen3":
        cfg = tf.Qwen3Config(
            hidden_size=16,
            intermediate_size=24,
            head_dim=4,
            num_hidden_layers=2,
            attention_bias=True,
            **common,
        )
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "llama":
        cfg = tf.LlamaConfig(
            hidden_size=16,
            intermediate_size=24,
            head_dim=4,
            num_hidden_layers=1,
            attention_bias=True,
            mlp_bias=True,
            **common,
        )
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            hidden_size=32,
            intermediate_size=24,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=8,
            num_experts=6,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            mlp_only_layers=[0],
            **common,
        )
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            hidden_size=16,
            intermediate_size=24,
            moe_intermediate_size=16,
            num_experts=6,
            num_experts_per_tok=2,
            head_dim=4,
            num_hidden_layers=1,
            **common,
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        raise AssertionError(kind)
    gen = torch.Generator().manual_seed(0)
    params = {
        n: torch.randint(1, 1 << 20, p.shape, generator=gen).to(torch.float32)
        for n, p in model.named_parameters()
    }
    return cfg, params


def _per_expert(params: dict, num_experts: int, inter: int) -> dict:
    """transformers 5 stacks experts; the checkpoint (and vLLM's loader) names them one by one."""
    out = {}
    for name, t in params.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name.removesuffix("gate_up_proj")
            for e in range(num_experts):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{p}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            p = name.removesuffix("down_proj")
            for e in range(num_experts):
                out[f"{p}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


# ---- the reference: vLLM's loaders, from the full tensors ---------------------------------------
def _vllm_expert_ids(num, ep, r, placement):
    if ep == 1:
        return list(range(num))
    if placement == "round_robin":
        return list(range(r, num, ep))
    base, rem = num // ep, num % ep
    start = r * base + min(r, rem)
    return list(range(start, start + base + (1 if r < rem else 0)))


def _reference(cfg, full, tp, r, *, expert_parallel=False, placement="linear"):
    H, hd, K, Hq = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    q_r = Hq // tp * hd
    if tp >= K:  # QKVParallelLinear: one KV head per rank, replicated tp // K times
        kv_local, kv_shard = 1, r // (tp // K)
    else:
        kv_local, kv_shard = K // tp, r
    kv_rows = slice(kv_shard * kv_local * hd, (kv_shard + 1) * kv_local * hd)
    out = {}

    def vocab(name):
        padded = -(-cfg.vocab_size // 64) * 64
        per = padded // tp
        rows = full[name][r * per : min((r + 1) * per, cfg.vocab_size)]
        out[name] = torch.cat([rows, torch.zeros(per - rows.shape[0], H)])

    def mlp(p, inter, bias):
        ir = inter // tp
        rows = slice(r * ir, (r + 1) * ir)
        out[f"{p}.gate_up_proj.weight"] = torch.cat(
            [full[f"{p}.gate_proj.weight"][rows], full[f"{p}.up_proj.weight"][rows]]
        )
        out[f"{p}.down_proj.weight"] = full[f"{p}.down_proj.weight"][:, rows]
        if bias:
            out[f"{p}.gate_up_proj.bias"] = torch.cat(
                [full[f"{p}.gate_proj.bias"][rows], full[f"{p}.up_proj.bias"][rows]]
            )
            out[f"{p}.down_proj.bias"] = full[f"{p}.down_proj.bias"]

    vocab("model.embed_tokens.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        for kind in ("weight", "bias"):
            if f"{a}.q_proj.{kind}" in full:
                q = full[f"{a}.q_proj.{kind}"][r * q_r : (r + 1) * q_r]
                k, v = full[f"{a}.k_proj.{kind}"][kv_rows], full[f"{a}.v_proj.{kind}"][kv_rows]
                out[f"{a}.qkv_proj.{kind}"] = torch.cat([q, k, v])
        out[f"{a}.o_proj.weight"] = full[f"{a}.o_proj.weight"][:, r * q_r : (r + 1) * q_r]
        for name in (f"{a}.o_proj.bias", f"{a}.q_norm.weight", f"{a}.k_norm.weight"):
            if name in full:
                out[name] = full[name]
        for name in (f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"):
            out[name] = full[name]
        if f"{p}.mlp.gate.weight" in full:
            out[f"{p}.mlp.gate.weight"] = full[f"{p}.mlp.gate.weight"]
            E, inter = cfg.num_experts, cfg.moe_intermediate_size
            split, er = (1, 0) if expert_parallel else (tp, r)
            ir = inter // split
            rows = slice(er * ir, (er + 1) * ir)
            ids = _vllm_expert_ids(E, tp if expert_parallel else 1, r, placement)
            e = f"{p}.mlp.experts"
            w13 = [
                torch.cat([full[f"{e}.{x}.gate_proj.weight"][rows], full[f"{e}.{x}.up_proj.weight"][rows]])
                for x in ids
            ]
            out[f"{e}.w13_weight"] = torch.stack(w13) if ids else torch.empty(0, 2 * ir, H)
            w2 = [full[f"{e}.{x}.down_proj.weight"][:, rows] for x in ids]
            out[f"{e}.w2_weight"] = torch.stack(w2) if ids else torch.empty(0, H, ir)
            if f"{p}.mlp.shared_expert.gate_proj.weight" in full:
                mlp(f"{p}.mlp.shared_expert", cfg.shared_expert_intermediate_size, False)
                out[f"{p}.mlp.shared_expert_gate.weight"] = full[f"{p}.mlp.shared_expert_gate.weight"]
        else:
            mlp(f"{p}.mlp", cfg.intermediate_size, f"{p}.mlp.gate_proj.bias" in full)
    out["model.norm.weight"] = full["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        vocab("lm_head.weight")
    return out


def _padding_mask(name, t, cfg, tp, r):
    """Which elements of a reference fused tensor are vocabulary padding (left zero)."""
    mask = torch.zeros(t.shape, dtype=torch.bool)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        per = pad_vocab_size(cfg.vocab_size) // tp
        mask[max(0, min(per, cfg.vocab_size - r * per)) :] = True
    return mask


def _box(offset, shape):
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _expected_multiplicity(name, cfg, tp, expert_parallel):
    replicated = ("layernorm.weight", "norm.weight", "mlp.gate.weight", "shared_expert_gate.weight")
    if name.endswith(replicated) or name.endswith(("o_proj.bias", "down_proj.bias")):
        return tp
    if ".k_proj." in name or ".v_proj." in name:
        return max(1, tp // cfg.num_key_value_heads)
    return 1


def _check_layout(kind, hf_cfg, params, tp, *, expert_parallel=False, placement="linear", names="per_expert"):
    cfg = DecoderConfig.from_hf(hf_cfg)
    full = _per_expert(params, cfg.num_experts, cfg.moe_intermediate_size) if cfg.num_experts else params
    canonical = params if names == "stacked" else full
    counts = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in canonical.items()}
    seen = set()  # with expert parallelism a rank views only its own experts
    per_rank = []
    for r in range(tp):
        layout = FusedLayout(
            hf_cfg, tp, r, expert_parallel=expert_parallel, expert_placement=placement, expert_names=names
        )
        ref = _reference(cfg, full, tp, r, expert_parallel=expert_parallel, placement=placement)
        assert layout.fused_shapes() == {n: tuple(t.shape) for n, t in ref.items()}, (kind, tp, r)
        # allocate(): shapes and dtype as asked, padding rows zero.
        alloc = layout.allocate(torch.bfloat16)
        for n, t in alloc.items():
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == tuple(ref[n].shape)
            assert bool((t[_padding_mask(n, t, cfg, tp, r)] == 0).all()), n
        # Write through the views into sentinel-filled fused tensors: must give the reference.
        fused = {n: torch.full(t.shape, SENTINEL) for n, t in ref.items()}
        for n, t in fused.items():
            t[_padding_mask(n, t, cfg, tp, r)] = 0
        views = layout.views(fused)
        metas = layout.metas("float32", rank=100 + r)
        per_rank.append(metas)
        assert [m.name for m in metas] == list(views)
        assert set(views) <= set(canonical) - set(layout.tied), (kind, tp, r)
        seen.update(views)
        for meta in metas:
            assert meta.global_shape == tuple(canonical[meta.name].shape), meta.name
            for piece in meta.pieces():
                assert piece.rank == 100 + r
                src = canonical[meta.name][_box(piece.global_offset, piece.shape)]
                views[meta.name][_box(piece.local, piece.shape)] = src
                counts[meta.name][_box(piece.global_offset, piece.shape)] += 1
        for n, t in ref.items():
            assert torch.equal(fused[n], t), f"{kind} tp={tp} rank={r}: fused {n} differs from vLLM's"
        # Read: the views of the reference are the global slices the metas name.
        ref_views = layout.views(ref)
        for meta in metas:
            covered = torch.zeros(ref_views[meta.name].shape, dtype=torch.int32)
            for piece in meta.pieces():
                got = ref_views[meta.name][_box(piece.local, piece.shape)]
                assert torch.equal(got, canonical[meta.name][_box(piece.global_offset, piece.shape)])
                covered[_box(piece.local, piece.shape)] += 1
            assert bool((covered == 1).all()), f"{meta.name}: pieces do not tile the view"
    assert seen == set(canonical) - set(layout.tied), (kind, tp)
    validate_metas(merge_metas(per_rank))
    for n, c in counts.items():
        if n in layout.tied:
            assert int(c.sum()) == 0
            continue
        want = _expected_multiplicity(n, cfg, tp, expert_parallel)
        assert bool((c == want).all()), (
            f"{kind} tp={tp}: {n} covered {sorted(set(c.flatten().tolist()))} != {want}"
        )


@pytest.fixture(scope="module")
def models():
    return {
        "qwen3": _hf_model("qwen3"),
        "qwen3_tied": _hf_model("qwen3", tied=True),
        "llama": _hf_model("llama"),
        "qwen2_moe": _hf_model("qwen2_moe"),
        "qwen3_moe": _hf_model("qwen3_moe"),
    }


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_tied", "llama", "qwen2_moe"])
def test_fused_views_match_vllm(models, kind, tp):
    cfg, params = models[kind]
    _check_layout(kind, cfg, params, tp)


@pytest.mark.parametrize("tp", TPS)
def test_stacked_expert_names(models, tp):
    """transformers-5 stacked expert tensors: one view (the whole w13 / w2), gate and up pieces
    at local offsets."""
    cfg, params = models["qwen3_moe"]
    _check_layout("qwen3_moe", cfg, params, tp, names="stacked")


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("names", ["per_expert", "stacked"])
@pytest.mark.parametrize("tp", [2, 4])
def test_expert_parallel(models, tp, names, placement):
    """6 experts over EP 4 is uneven (2, 2, 1, 1 linear; {0,4}, {1,5}, {2}, {3} round robin)."""
    cfg, params = models["qwen3_moe"]
    _check_layout("qwen3_moe", cfg, params, tp, expert_parallel=True, placement=placement, names=names)


def test_tied_embeddings_written_once(models):
    cfg, _ = models["qwen3_tied"]
    layout = FusedLayout(cfg, 2, 1)
    assert layout.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in layout.fused_shapes()
    assert "lm_head.weight" not in {m.name for m in layout.metas("bfloat16")}
    fused = layout.allocate(torch.float32)
    layout.views({**fused, "lm_head.weight": fused["model.embed_tokens.weight"]})  # vLLM shares it
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        layout.views({**fused, "lm_head.weight": fused["model.embed_tokens.weight"].clone()})


def test_vocab_padding_rule():
    """vLLM pads to a multiple of 64, then splits evenly: V=100 -> 128 rows; at TP 8 rank 6 holds
    rows 96..99 and rank 7 none (an empty view, a meta without pieces)."""
    cfg = DecoderConfig(16, 8, 2, 2, 24, 100, 0)
    assert [FusedLayout(cfg, 8, r).vocab_rows() for r in (0, 6, 7)] == [
        (0, 16, 16),
        (96, 4, 16),
        (112, 0, 16),
    ]
    layout = FusedLayout(cfg, 8, 7)
    assert layout.metas("bfloat16")[0].shards == ()
    assert layout.views(layout.allocate(torch.float32))["model.embed_tokens.weight"].shape == (0, 16)
    assert pad_vocab_size(151936) == 151936 and pad_vocab_size(151937) == 152000


def test_errors_name_the_problem():
    cfg = DecoderConfig(16, 8, 2, 4, 24, 100, 1)
    with pytest.raises(ValueError, match="padded vocab of vocab_size 100=128 is not divisible by tp_size=3"):
        FusedLayout(cfg, 3, 0)
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by tp_size=3"):
        FusedLayout(DecoderConfig(16, 8, 2, 4, 24, 150, 1), 3, 0)
    with pytest.raises(ValueError, match="tp_size=6 is not divisible by num_key_value_heads=4"):
        FusedLayout(DecoderConfig(16, 12, 4, 4, 24, 150, 1), 6, 0)
    with pytest.raises(ValueError, match=r"tp_rank 4 is not in \[0, tp_size=4\)"):
        FusedLayout(cfg, 4, 4)
    layout = FusedLayout(cfg, 2, 0)
    fused = layout.allocate(torch.float32)
    bad = {**fused, "model.layers.0.self_attn.qkv_proj.weight": torch.empty(3, 16)}
    with pytest.raises(ValueError, match=r"qkv_proj.weight' on tp rank 0 has shape \(3, 16\)"):
        layout.views(bad)
    with pytest.raises(KeyError, match=r"o_proj\.weight"):
        layout.views({k: v for k, v in fused.items() if "o_proj" not in k})
    with pytest.raises(ValueError, match="model_type 'deepseek_v3'"):
        DecoderConfig.from_hf({"model_type": "deepseek_v3"})
