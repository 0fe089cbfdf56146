"""A Llama / Qwen2 / Qwen3 decoder in vLLM's per-TP-rank fused layout, with a slot KV cache.

Why our own decoder and not ``transformers``: inference engines hold weights *fused and split*
(vLLM's ``qkv_proj`` = ``[q_r | k_r | v_r]`` per TP rank, ``gate_up_proj`` = ``[gate_r | up_r]``,
row-parallel ``o_proj`` / ``down_proj``, vocab-parallel ``embed_tokens`` / ``lm_head`` padded to
a multiple of 64 x TP), and weight sync must write into exactly that memory. This file is that
engine's model, readable top to bottom like gpt-fast's ``model.py``; the per-rank arithmetic is
in `python_engines.inference.tp`.

Parameter names are vLLM's (``model.layers.{i}.self_attn.qkv_proj.weight``, ...); canonical
Hugging Face views into them come from `python_engines.inference.weights`.

Attention reads a KV cache of ``num_slots`` sequences (`python_engines.inference.kv_cache`):
one forward call takes a ``[B, T]`` block of tokens with their positions, writes their keys and
values at ``(write_slot, position)`` and attends each row to its own slot's positions
``<= position``. Prefill is ``T = prompt length``; decode is ``T = 1`` for every running request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from python_engines.inference.tp import TPContext, TPShapes

__all__ = ["ModelArgs", "Transformer", "rope_inv_freq"]


@dataclass
class ModelArgs:
    """The decoder's hyper-parameters, read from a Hugging Face ``config.json`` dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "qwen2"
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Build from a ``config.json`` dict of a Llama, Qwen2 or Qwen3 model.

        RoPE settings come from ``rope_parameters`` (transformers 5) or the older top-level
        ``rope_theta`` / ``rope_scaling``. Raises ValueError naming an unsupported field.
        """
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ValueError(f"config model_type={model_type!r} is not a Llama/Qwen2/Qwen3 decoder")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config hidden_act={cfg.get('hidden_act')!r}: only 'silu' is supported")
        if cfg.get("mlp_bias"):
            raise ValueError("config mlp_bias=True is not supported")
        heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or None
        if scaling:
            rope = {**dict(scaling), **rope}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            model_type=model_type,
            hf_config=dict(cfg),
        )


# ---------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin scale factor.

    ``default``, ``linear`` and ``llama3`` are computed here; other scaling types (``yarn``,
    ``longrope``) are delegated to transformers' ``ROPE_INIT_FUNCTIONS`` so that they match it.
    """
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "default":
        return inv_freq.float(), 1.0
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float(), 1.0
    if kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        medium = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, medium, scaled).float(), 1.0
    if kind == "dynamic":
        raise ValueError("rope_type='dynamic' (length-dependent NTK scaling) is not supported")
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type={kind!r}")
    inv, attention_factor = ROPE_INIT_FUNCTIONS[kind](PretrainedConfig(**args.hf_config), torch.device("cpu"))
    return inv.float(), float(attention_factor)


def rope_cos_sin(args: ModelArgs, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_len, head_dim]`` (float32, halves repeated as HF does)."""
    inv_freq, scale = rope_inv_freq(args)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, heads, head_dim]`` by ``cos``/``sin`` ``[B, T, 1, head_dim]``
    (the non-interleaved "rotate half" convention of Llama/Qwen checkpoints)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


# ---------------------------------------------------------------------------------------- blocks


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers' Llama/Qwen2 do."""

    def __init__(self, dim: int, eps: float) -> None:
        """A norm over the last ``dim`` features."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim of ``x``."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_r^T) + b``: ``weight`` is ``[out, in / tp]``, ``bias`` full."""

    def __init__(self, in_local: int, out: int, bias: bool, tp: TPContext) -> None:
        """Allocate this rank's column block (and the replicated bias)."""
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out, in_local))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Partial product, summed over the TP group, plus the bias once."""
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class Attention(nn.Module):
    """GQA self-attention over the slot KV cache; ``qkv_proj`` is ``[q_r | k_r | v_r]``."""

    def __init__(self, args: ModelArgs, shapes: TPShapes) -> None:
        """Allocate this rank's fused qkv rows and o_proj columns."""
        super().__init__()
        self.shapes = shapes
        s = shapes
        self.qkv_proj = nn.Linear(args.hidden_size, s.q_size + 2 * s.kv_size, bias=args.qkv_bias)
        self.o_proj = RowParallelLinear(s.q_size, args.hidden_size, args.o_bias, s.tp)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.qk_norm = args.qk_norm

    def forward(
        self, x: torch.Tensor, ctx: StepContext, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> torch.Tensor:
        """``x`` ``[B, T, hidden]`` -> ``[B, T, hidden]``; writes this step's keys and values
        into ``cache_k`` / ``cache_v`` ``[num_slots + 1, max_len, kv_heads_local, head_dim]``."""
        s = self.shapes
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = q.view(B, T, s.num_heads_local, s.head_dim)
        k = k.view(B, T, s.num_kv_heads_local, s.head_dim)
        v = v.view(B, T, s.num_kv_heads_local, s.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        cache_k[ctx.write_slots, ctx.positions] = k.to(cache_k.dtype)
        cache_v[ctx.write_slots, ctx.positions] = v.to(cache_v.dtype)
        keys = cache_k[ctx.read_slots, : ctx.key_len].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
        values = cache_v[ctx.read_slots, : ctx.key_len].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=ctx.mask, enable_gqa=True
        )  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, s.q_size))


class MLP(nn.Module):
    """SwiGLU with fused ``gate_up_proj`` ``[gate_r | up_r]`` and row-parallel ``down_proj``."""

    def __init__(self, args: ModelArgs, shapes: TPShapes) -> None:
        """Allocate this rank's gate/up rows and down columns."""
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * shapes.intermediate_local, bias=False)
        self.down_proj = RowParallelLinear(shapes.intermediate_local, args.hidden_size, False, shapes.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, args: ModelArgs, shapes: TPShapes) -> None:
        """One decoder layer of this rank."""
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, shapes)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, shapes)

    def forward(
        self, x: torch.Tensor, ctx: StepContext, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> torch.Tensor:
        """``x + attn(norm(x))``, then ``+ mlp(norm(.))``."""
        x = x + self.self_attn(self.input_layernorm(x), ctx, cache_k, cache_v)
        return x + self.mlp(self.post_attention_layernorm(x))


class VocabParallelEmbedding(nn.Module):
    """Embedding whose padded rows are split over TP ranks; out-of-range ids contribute zeros."""

    def __init__(self, shapes: TPShapes, hidden: int) -> None:
        """Allocate this rank's ``[vocab_local, hidden]`` rows (padding rows stay zero)."""
        super().__init__()
        self.shapes = shapes
        self.weight = nn.Parameter(torch.zeros(shapes.vocab_local, hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Look up ``tokens`` (global ids) and sum the ranks' partial embeddings."""
        s = self.shapes
        local = tokens - s.vocab_start
        mine = (local >= 0) & (local < s.vocab_local)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight)
        return s.tp.all_reduce(out.masked_fill(~mine.unsqueeze(-1), 0.0))


@dataclass
class StepContext:
    """Per-step inputs shared by every layer (positions, slots, RoPE rows, mask)."""

    positions: torch.Tensor  # [B, T] int64
    write_slots: torch.Tensor  # [B, T] int64: slot each token's K/V is written to
    read_slots: torch.Tensor  # [B] int64: slot each row attends to
    key_len: int  # keys gathered per row: max position + 1
    cos: torch.Tensor  # [B, T, 1, head_dim]
    sin: torch.Tensor
    mask: torch.Tensor  # [B, 1, T, key_len] bool: key position <= query position


class Transformer(nn.Module):
    """The whole decoder of one TP rank. ``forward`` returns full-vocabulary logits."""

    def __init__(self, args: ModelArgs, tp: TPContext, max_seq_len: int,
                 dtype: torch.dtype = torch.float32) -> None:
        """Allocate this rank's parameters in ``dtype`` (uninitialised; load them or use
        `init_random_weights`) and float32 RoPE tables for positions ``< max_seq_len``."""
        super().__init__()
        self.args = args
        self.shapes = TPShapes(
            tp, args.num_heads, args.num_kv_heads, args.head_dim, args.intermediate_size, args.vocab_size
        )
        self.max_seq_len = max_seq_len
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(self.shapes, args.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(args, self.shapes) for _ in range(args.num_layers))
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = nn.Parameter(torch.zeros(self.shapes.vocab_local, args.hidden_size))
        self.to(dtype)
        cos, sin = rope_cos_sin(args, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection (the embedding itself when embeddings are tied)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def step_context(
        self, positions: torch.Tensor, write_slots: torch.Tensor, read_slots: torch.Tensor
    ) -> StepContext:
        """Precompute what every layer needs for a ``[B, T]`` block at ``positions``."""
        key_len = int(positions.max()) + 1
        if key_len > self.max_seq_len:
            raise ValueError(f"position {key_len - 1} exceeds the KV cache length {self.max_seq_len}")
        cos = self.rope_cos[positions].unsqueeze(2)
        sin = self.rope_sin[positions].unsqueeze(2)
        keys = torch.arange(key_len, device=positions.device)
        mask = keys.view(1, 1, 1, -1) <= positions.view(*positions.shape[:2], 1).unsqueeze(1)
        return StepContext(positions, write_slots, read_slots, key_len, cos, sin, mask)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, ctx: StepContext, cache: Any, logit_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32) at ``logit_index`` ``[B]`` of each row, or
        ``[B, T, vocab]`` for every token when ``logit_index`` is None (teacher forcing).

        ``cache`` has per-layer ``k[i]`` / ``v[i]`` tensors (`KVCache`). Collective over the TP
        group: every rank must call it with the same inputs.
        """
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, ctx, cache.k[i], cache.v[i])
        if logit_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logit_index]
        x = self.model.norm(x)
        logits = self.shapes.tp.all_gather_last_dim(F.linear(x, self.lm_head_weight).float())
        return logits[..., : self.args.vocab_size]
