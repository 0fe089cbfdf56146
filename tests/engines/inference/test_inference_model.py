"""The fused-layout decoder against transformers: teacher-forced logits, KV-cache decoding, TP.

Tolerances: everything runs in float32. Our decoder sums the same products in another order
(fused qkv / gate_up matmuls, vocab-parallel and row-parallel partial sums under TP), so logits
differ by float32 rounding accumulated over 2 layers of 64-128-wide dot products: about 3e-6 for
logits of magnitude ~7 here. ``atol=rtol=1e-4`` leaves a 30x margin while still catching any
layout error (a swapped head or a missing bias moves logits by >1e-1).
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from _inference_helpers import VOCAB, hf_logits, load_hf, make_checkpoint
from safetensors.torch import load_file, save_file

from python_engines.inference.kv_cache import KVCache
from python_engines.inference.model import ModelArgs, Transformer
from python_engines.inference.tp import TPContext
from python_engines.inference.weights import (
    canonical_views,
    init_random_weights,
    load_hf_weights,
    weight_metas,
)

TOL = {"atol": 1e-4, "rtol": 1e-4}

CONFIGS = {
    "qwen2": {},
    "qwen2-tied-mqa": {"tie_word_embeddings": True, "num_key_value_heads": 1},
    "llama3-rope-bias": {
        "model_type": "llama", "attention_bias": True, "head_dim": 16, "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    },
    "qwen3-qknorm": {"model_type": "qwen3", "head_dim": 32},
    "llama-linear-rope": {"model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
}


def build(path: str, tp: TPContext | None = None, max_len: int = 64) -> Transformer:
    import json
    from pathlib import Path

    args = ModelArgs.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    model = Transformer(args, tp or TPContext(), max_len).eval()
    load_hf_weights(model, path)
    return model


def teacher_forced(model: Transformer, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every position of each sequence, all sequences in one padded prefill block."""
    s = model.shapes
    cache = KVCache(model.args.num_layers, len(seqs), model.max_seq_len, s.num_kv_heads_local,
                    model.args.head_dim, torch.float32)
    T = max(map(len, seqs))
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    write = torch.full((len(seqs), T), cache.scratch_slot)
    for b, seq in enumerate(seqs):
        tokens[b, : len(seq)] = torch.tensor(seq)
        write[b, : len(seq)] = b
    positions = torch.arange(T).expand(len(seqs), T)
    ctx = model.step_context(positions, write, torch.arange(len(seqs)))
    logits = model(tokens, ctx, cache)
    return [logits[b, : len(seq)] for b, seq in enumerate(seqs)]


def random_seqs(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_teacher_forced_logits_match_transformers(tmp_path, name):
    path = make_checkpoint(tmp_path / name, seed=3, **CONFIGS[name])
    ours = build(path)
    ref = load_hf(path)
    seqs = random_seqs(5, [17, 9, 1])
    for seq, logits in zip(seqs, teacher_forced(ours, seqs), strict=True):
        torch.testing.assert_close(logits, hf_logits(ref, seq), **TOL)


def test_cached_decode_equals_full_forward(tmp_path):
    """Prefill 5 tokens, then decode one token at a time through the KV cache, in two slots at
    once: each step's logits equal the teacher-forced logits of the whole prefix."""
    path = make_checkpoint(tmp_path / "m", seed=4)
    model = build(path)
    ref = load_hf(path)
    seqs = random_seqs(6, [12, 12])
    cache = KVCache(model.args.num_layers, 4, 64, model.shapes.num_kv_heads_local, model.args.head_dim,
                    torch.float32)
    slots = torch.tensor([3, 1])  # not 0..B-1: slots are addresses, not row numbers
    prompt = torch.tensor([s[:5] for s in seqs])
    ctx = model.step_context(torch.arange(5).expand(2, 5), slots[:, None].expand(2, 5), slots)
    model(prompt, ctx, cache, torch.tensor([4, 4]))
    for pos in range(5, 12):
        tok = torch.tensor([[s[pos]] for s in seqs])
        ctx = model.step_context(torch.full((2, 1), pos), slots[:, None], slots)
        step = model(tok, ctx, cache, torch.zeros(2, dtype=torch.long))
        for b, seq in enumerate(seqs):
            torch.testing.assert_close(step[b], hf_logits(ref, seq[: pos + 1])[-1], **TOL)


def test_random_init_is_identical_across_tp_sizes():
    """init_random_weights draws each canonical tensor whole from (seed, name), so a TP=2 rank
    holds exactly the corresponding box of the TP=1 tensors."""
    from transformers import Qwen2Config

    args = ModelArgs.from_hf_config(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=1,
                                                vocab_size=20).to_dict())
    full = Transformer(args, TPContext(), 8)
    init_random_weights(full, seed=7, initializer_range=0.2)
    whole = {v.name: v.view for v in canonical_views(full)}
    for rank in range(4):
        part = Transformer(args, TPContext(rank, 4), 8)
        init_random_weights(part, seed=7, initializer_range=0.2)
        for v in canonical_views(part):
            assert torch.equal(v.view, whole[v.name][v.global_slices()]), (rank, v.name)
    assert part.shapes.vocab_padded == 64 and part.shapes.vocab_local == 16  # 20 -> 64 (vLLM pads to x64)
    names = {v.name for v in canonical_views(part)}
    assert "model.embed_tokens.weight" not in names  # rank 3 holds only padding rows


def test_layout_errors_name_the_field():
    base = {"model_type": "qwen2", "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 150}

    def make(tp: int, **changes):
        Transformer(ModelArgs.from_hf_config({**base, **changes}), TPContext(0, tp), 8)

    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tp_size=4"):
        make(4)
    with pytest.raises(ValueError, match="num_key_value_heads=3 is not divisible by tp_size=2"):
        make(2)
    with pytest.raises(ValueError, match="exceeds num_key_value_heads=3 but is not a multiple"):
        make(4, num_attention_heads=12)
    with pytest.raises(ValueError, match="intermediate_size=64 is not divisible by tp_size=3"):
        make(3)
    with pytest.raises(ValueError, match=r"padded vocabulary 64 .* not divisible by tp_size=3"):
        make(3, intermediate_size=60, vocab_size=64)
    with pytest.raises(ValueError, match="hidden_act"):
        ModelArgs.from_hf_config({**base, "hidden_act": "gelu"})
    model = Transformer(ModelArgs.from_hf_config({**base, "intermediate_size": 60}), TPContext(5, 6), 8)
    assert model.shapes.kv_head_start == 2 and model.shapes.vocab_local == 32  # 6 ranks over 3 KV heads
    assert {m.name for m in weight_metas(model)} >= {"model.layers.0.self_attn.k_proj.weight"}


# ---------------------------------------------------------------------------------------- TP


def _tp_worker(rank: int, world_size: int, paths: list[str], out_dir: str) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = {}
    for path in paths:
        model = build(path, TPContext(rank, world_size, dist.group.WORLD))
        seqs = random_seqs(8, [15, 6])
        logits = teacher_forced(model, seqs)
        tensors = {f"logits{b}": t.contiguous() for b, t in enumerate(logits)}
        tensors |= {f"view.{v.name}": v.view.contiguous() for v in canonical_views(model)}
        name = path.rstrip("/").rsplit("/", 1)[-1]
        save_file(tensors, f"{out_dir}/{name}.rank{rank}.safetensors")
        result[name] = {v.name: [list(v.global_offset), list(v.view.shape)] for v in canonical_views(model)}
    return result


@pytest.mark.timeout(240)
def test_tp2_logits_and_views_match_including_replicated_kv_heads(tmp_path):
    """TP=2 on 2 KV heads (split) and on 1 KV head (replicated: both ranks read head 0): every
    rank's logits equal transformers', and the canonical views reassemble the checkpoint."""
    paths = [make_checkpoint(tmp_path / "kv2", seed=11),
             make_checkpoint(tmp_path / "kv1", seed=12, num_key_value_heads=1)]
    boxes = run_world(_tp_worker, 2, paths, str(tmp_path), timeout=200)
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        ref_model = load_hf(path)
        state = load_file(f"{path}/model.safetensors")
        seqs = random_seqs(8, [15, 6])
        covered = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in state.items()}
        for rank in range(2):
            got = load_file(f"{tmp_path}/{name}.rank{rank}.safetensors")
            for b, seq in enumerate(seqs):
                torch.testing.assert_close(got[f"logits{b}"], hf_logits(ref_model, seq), **TOL)
            for canon, (offset, shape) in boxes[rank][name].items():
                box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                assert torch.equal(got[f"view.{canon}"], state[canon][box]), (rank, canon)
                covered[canon][box] += 1
        kv_heads = 1 if name == "kv1" else 2
        for canon, count in covered.items():
            replicated = "norm" in canon or (kv_heads == 1 and ("k_proj" in canon or "v_proj" in canon))
            assert int(count.min()) == int(count.max()) == (2 if replicated else 1), canon
