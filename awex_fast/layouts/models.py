"""Named real model shapes: every parameter's canonical Hugging Face name and global shape.

The planner's benchmarks and the `awex-fast plan` command need realistic metadata for models
that do not fit on this machine, so this module writes the tensor lists down from each model's
published config (hidden sizes, heads, experts, vocabulary) instead of loading weights. Each
tensor also says how Megatron / vLLM split it (`TensorSpec.tp_dim`, `kv_heads`, `expert`,
`layer`), which `awex_fast.layouts.synthetic` turns into training and inference layouts.

MoE experts use the checkpoint names (``mlp.experts.{e}.gate_proj.weight``), one tensor per
expert and matrix, as vLLM and SGLang load them; weights are bfloat16 except DeepSeek-V3's
``e_score_correction_bias`` (float32). Kimi-K2 ships FP8 block-quantised experts; the shapes here
are the unquantised ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """One parameter. ``tp_dim``: the dim tensor parallelism splits (0 column-parallel and vocab,
    1 row-parallel, None replicated); ``kv_heads``: for k/v projections, the KV head count (TP
    beyond it replicates heads); ``layer``: decoder layer, -1 for the embedding, ``num_layers``
    for the final norm and lm_head (pipeline stage placement); ``expert``: routed expert index."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    layer: int = -1
    expert: int | None = None
    kv_heads: int | None = None
    dtype: str = "bfloat16"

    @property
    def numel(self) -> int:
        """Elements in the tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSpec:
    """A model's parameter list in checkpoint order."""

    name: str
    num_layers: int
    num_experts: int
    tensors: tuple[TensorSpec, ...]

    @property
    def num_params(self) -> int:
        """Total elements over all tensors."""
        return sum(t.numel for t in self.tensors)


@dataclass(frozen=True)
class _Dense:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None
    qkv_bias: bool = True
    qk_norm: bool = False
    tied: bool = False


def _attention(p: str, c: _Dense, layer: int) -> list[TensorSpec]:
    hd = c.head_dim or c.hidden // c.heads
    q, kv = c.heads * hd, c.kv_heads * hd
    out = [
        TensorSpec(f"{p}.self_attn.q_proj.weight", (q, c.hidden), 0, layer),
        TensorSpec(f"{p}.self_attn.k_proj.weight", (kv, c.hidden), 0, layer, kv_heads=c.kv_heads),
        TensorSpec(f"{p}.self_attn.v_proj.weight", (kv, c.hidden), 0, layer, kv_heads=c.kv_heads),
    ]
    if c.qkv_bias:
        out += [
            TensorSpec(f"{p}.self_attn.q_proj.bias", (q,), 0, layer),
            TensorSpec(f"{p}.self_attn.k_proj.bias", (kv,), 0, layer, kv_heads=c.kv_heads),
            TensorSpec(f"{p}.self_attn.v_proj.bias", (kv,), 0, layer, kv_heads=c.kv_heads),
        ]
    out.append(TensorSpec(f"{p}.self_attn.o_proj.weight", (c.hidden, q), 1, layer))
    if c.qk_norm:
        out += [
            TensorSpec(f"{p}.self_attn.q_norm.weight", (hd,), None, layer),
            TensorSpec(f"{p}.self_attn.k_norm.weight", (hd,), None, layer),
        ]
    return out


def _mlp(p: str, hidden: int, inter: int, layer: int, expert: int | None = None) -> list[TensorSpec]:
    return [
        TensorSpec(f"{p}.gate_proj.weight", (inter, hidden), 0, layer, expert),
        TensorSpec(f"{p}.up_proj.weight", (inter, hidden), 0, layer, expert),
        TensorSpec(f"{p}.down_proj.weight", (hidden, inter), 1, layer, expert),
    ]


def _norms(p: str, hidden: int, layer: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{p}.input_layernorm.weight", (hidden,), None, layer),
        TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), None, layer),
    ]


def _ends(c: _Dense, layers: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    head = [TensorSpec("model.embed_tokens.weight", (c.vocab, c.hidden), 0, -1)]
    tail = [TensorSpec("model.norm.weight", (c.hidden,), None, layers)]
    if not c.tied:
        tail.append(TensorSpec("lm_head.weight", (c.vocab, c.hidden), 0, layers))
    return head, tail


def _qwen2(name: str, c: _Dense) -> Callable[[int | None], ModelSpec]:
    def build(layers: int | None = None) -> ModelSpec:
        n = c.layers if layers is None else layers
        head, tail = _ends(c, n)
        body: list[TensorSpec] = []
        for i in range(n):
            p = f"model.layers.{i}"
            body += _norms(p, c.hidden, i) + _attention(p, c, i)
            body += _mlp(f"{p}.mlp", c.hidden, c.intermediate, i)
        return ModelSpec(name, n, 0, tuple(head + body + tail))

    return build


def _qwen3_moe(name: str, c: _Dense, experts: int, moe_inter: int) -> Callable[[int | None], ModelSpec]:
    def build(layers: int | None = None) -> ModelSpec:
        n = c.layers if layers is None else layers
        head, tail = _ends(c, n)
        body: list[TensorSpec] = []
        for i in range(n):
            p = f"model.layers.{i}"
            body += _norms(p, c.hidden, i) + _attention(p, c, i)
            body.append(TensorSpec(f"{p}.mlp.gate.weight", (experts, c.hidden), None, i))
            for e in range(experts):
                body += _mlp(f"{p}.mlp.experts.{e}", c.hidden, moe_inter, i, e)
        return ModelSpec(name, n, experts, tuple(head + body + tail))

    return build


def _deepseek_v3(
    name: str, c: _Dense, experts: int, moe_inter: int, dense_layers: int, q_lora: int, kv_lora: int,
    nope: int, rope: int, v_dim: int, shared: int,
) -> Callable[[int | None], ModelSpec]:  # fmt: skip
    def build(layers: int | None = None) -> ModelSpec:
        n = c.layers if layers is None else layers
        head, tail = _ends(c, n)
        H, nh = c.hidden, c.heads
        body: list[TensorSpec] = []
        for i in range(n):
            p = f"model.layers.{i}"
            a = f"{p}.self_attn"
            body += _norms(p, H, i)
            body += [
                TensorSpec(f"{a}.q_a_proj.weight", (q_lora, H), None, i),
                TensorSpec(f"{a}.q_a_layernorm.weight", (q_lora,), None, i),
                TensorSpec(f"{a}.q_b_proj.weight", (nh * (nope + rope), q_lora), 0, i),
                TensorSpec(f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, H), None, i),
                TensorSpec(f"{a}.kv_a_layernorm.weight", (kv_lora,), None, i),
                TensorSpec(f"{a}.kv_b_proj.weight", (nh * (nope + v_dim), kv_lora), 0, i),
                TensorSpec(f"{a}.o_proj.weight", (H, nh * v_dim), 1, i),
            ]
            if i < dense_layers:
                body += _mlp(f"{p}.mlp", H, c.intermediate, i)
                continue
            body += [
                TensorSpec(f"{p}.mlp.gate.weight", (experts, H), None, i),
                TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (experts,), None, i, dtype="float32"),
            ]
            body += _mlp(f"{p}.mlp.shared_experts", H, moe_inter * shared, i)
            for e in range(experts):
                body += _mlp(f"{p}.mlp.experts.{e}", H, moe_inter, i, e)
        return ModelSpec(name, n, experts, tuple(head + body + tail))

    return build


_MODELS: dict[str, Callable[[int | None], ModelSpec]] = {
    "qwen2.5-0.5b": _qwen2("Qwen2.5-0.5B", _Dense(896, 4864, 24, 14, 2, 151936, tied=True)),
    # every linear of it splits into whole 128x128 blocks at TP2 (0.5B's does not): the FP8 bench shape
    "qwen2.5-1.5b": _qwen2("Qwen2.5-1.5B", _Dense(1536, 8960, 28, 12, 2, 151936, tied=True)),
    "qwen2.5-7b": _qwen2("Qwen2.5-7B", _Dense(3584, 18944, 28, 28, 4, 152064)),
    "qwen2.5-72b": _qwen2("Qwen2.5-72B", _Dense(8192, 29568, 80, 64, 8, 152064)),
    "qwen3-235b-a22b": _qwen3_moe(
        "Qwen3-235B-A22B", _Dense(4096, 12288, 94, 64, 4, 151936, 128, False, True), 128, 1536
    ),
    "kimi-k2": _deepseek_v3(
        "Kimi-K2", _Dense(7168, 18432, 61, 64, 64, 163840, qkv_bias=False), 384, 2048, 1, 1536, 512,
        128, 64, 128, 1,
    ),
    # DeepSeek-V3 (671B): Kimi-K2's architecture with 128 heads, 256 experts, 3 dense layers.
    "deepseek-v3": _deepseek_v3(
        "DeepSeek-V3", _Dense(7168, 18432, 61, 128, 128, 129280, qkv_bias=False), 256, 2048, 3, 1536, 512,
        128, 64, 128, 1,
    ),
    # A small-expert MoE (Qwen3-MoE naming): 8 layers x 64 experts of 256 x 512.
    "small-moe": _qwen3_moe("small-moe", _Dense(512, 1024, 8, 8, 2, 32000, 64, False, True), 64, 256),
    # Tiny shapes of the same families, small enough to move real tensors in tests.
    "tiny-dense": _qwen2("tiny-dense", _Dense(64, 96, 2, 4, 2, 160, tied=False)),
    "tiny-moe": _qwen3_moe("tiny-moe", _Dense(32, 48, 2, 4, 2, 96, 8, False, True), 8, 16),
    "tiny-mla": _deepseek_v3(
        "tiny-mla", _Dense(32, 64, 2, 4, 4, 96, qkv_bias=False), 8, 16, 1, 24, 16, 8, 4, 8, 1
    ),
}
DEFAULT_MODEL = "qwen2.5-0.5b"


def model_names() -> list[str]:
    """Names `model_spec` accepts (case-insensitive)."""
    return list(_MODELS)


def model_spec(name: str, layers: int | None = None) -> ModelSpec:
    """The tensor list of a named model; ``layers`` overrides its decoder layer count."""
    key = name.lower()
    if key not in _MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(_MODELS)}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    return _MODELS[key](layers)


__all__ = ["DEFAULT_MODEL", "ModelSpec", "TensorSpec", "model_names", "model_spec"]
