"""Inference engines' fused per-rank tensors (vLLM / SGLang layout) seen as canonical HF views.

Why: an inference engine holds ``qkv_proj``, ``gate_up_proj`` and MoE ``w13`` / ``w2`` fused and
TP-split, while weight sync speaks canonical Hugging Face names and global boxes. `FusedLayout`
is the single table that says, for one TP rank, which slice of which fused tensor holds which
box of which canonical tensor; from it come the canonical *views* (``fused[...]`` slices, so a
write into a view lands in the engine's parameter), the rank's `ParameterMeta` list, the fused
tensors' shapes, and an allocator for them. vLLM's rules, per TP rank ``r`` of ``tp``:

=============================  ==========================================  ===================
fused tensor (vLLM name)       per-rank content                            canonical views
=============================  ==========================================  ===================
``self_attn.qkv_proj.weight``  ``[q_r | k_r | v_r]`` rows; q heads split;   q/k/v_proj.weight
(and ``.bias``)                KV heads split, or when tp > num_kv_heads
                               replicated: rank r holds KV head
                               ``r // (tp // num_kv_heads)``
                               (``QKVParallelLinear``)
``self_attn.o_proj.weight``    columns ``[r*q_r, (r+1)*q_r)`` (row-par.)    o_proj.weight
``mlp.gate_up_proj.weight``    ``[gate_r | up_r]`` rows                     gate/up_proj.weight
``mlp.down_proj.weight``       columns ``[r*i_r, (r+1)*i_r)``               down_proj.weight
``mlp.experts.w13_weight``     ``[E_local, 2*i_r, H]``: gate_r then up_r    experts.{e}.gate/up
``mlp.experts.w2_weight``      ``[E_local, H, i_r]``                        experts.{e}.down
``embed_tokens`` / lm_head     padded rows ``[r*V_r, (r+1)*V_r)``           leading valid rows
norms, router, biases of       whole tensor                                 the tensor
row-parallel layers
=============================  ==========================================  ===================

Vocabulary (``VocabParallelEmbedding`` / ``ParallelLMHead``, no LoRA vocab): the vocabulary is
padded to a multiple of 64 (``pad_vocab_size``), each rank holds ``padded // tp`` rows (vLLM
requires divisibility), rank r's rows ``[r*V_r, min((r+1)*V_r, V))`` come first and the rest of
its tensor is padding (zero). SGLang uses the same rule. Megatron pads differently (to a
multiple of 128 * tp); that is a training layout, see `awex_fast.layouts.megatron`.

MoE: by default every rank holds every expert, split by TP inside each expert (vLLM's FusedMoE
without expert parallelism). With ``expert_parallel=True`` experts are split over the TP ranks
(vLLM ``--enable-expert-parallel`` with DP 1: EP size = TP size, experts not TP-split), placed
``"linear"`` (contiguous blocks, the first ``E % ep`` ranks one more) or ``"round_robin"``, as
vLLM's ``determine_expert_map``. Canonical expert names are the checkpoint's per-expert names
(``mlp.experts.{e}.gate_proj.weight``) or, with ``expert_names="stacked"``, transformers 5's
stacked ``mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` / ``mlp.experts.down_proj`` ``[E, H, I]``,
whose views are the whole ``w13`` / ``w2`` with two pieces (gate and up) at local offsets.

Tied embeddings: ``lm_head.weight`` is not a separate canonical tensor; `FusedLayout.tied` maps
it to ``model.embed_tokens.weight``, which is written once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from awex_fast.meta import ParameterMeta, ShardMeta

__all__ = ["VOCAB_PADDING", "CanonicalSlot", "DecoderConfig", "FusedLayout", "pad_vocab_size"]

#: vLLM's and SGLang's ``DEFAULT_VOCAB_PADDING_SIZE``.
VOCAB_PADDING = 64

Index = tuple[int | slice, ...]
Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # global offset, shape, local offset


def pad_vocab_size(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """``vocab_size`` rounded up to a multiple of ``pad_to`` (vLLM's ``pad_vocab_size``)."""
    return -(-vocab_size // pad_to) * pad_to


def _get(config: Any, key: str, default: Any = None) -> Any:
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    return default if value is None else value


@dataclass(frozen=True)
class DecoderConfig:
    """The shape facts of a Llama / Qwen2 / Qwen3 (dense or MoE) decoder that fix its layout.

    ``moe_layers`` lists the layers whose MLP is a routed MoE (with ``num_experts`` experts of
    ``moe_intermediate_size``, a router ``mlp.gate.weight``, and a shared expert when
    ``shared_expert_intermediate_size`` > 0, Qwen2-MoE style); the others are dense.
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_hidden_layers: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, config: Any) -> DecoderConfig:
        """From a transformers config object or its dict (``config.json``). Supported model
        types: llama, mistral, qwen2, qwen3 (dense) and qwen2_moe, qwen3_moe; others raise
        ValueError, since their parameter names or attention differ (MLA, block_sparse_moe)."""
        model_type = str(_get(config, "model_type", ""))
        dense, moe = ("llama", "mistral", "qwen2", "qwen3"), ("qwen2_moe", "qwen3_moe")
        if model_type not in dense + moe:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {dense + moe}")
        heads = int(_get(config, "num_attention_heads"))
        hidden = int(_get(config, "hidden_size"))
        layers = int(_get(config, "num_hidden_layers"))
        attention_bias = bool(_get(config, "attention_bias", False))
        if model_type in ("qwen2", "qwen2_moe"):
            qkv_bias, o_bias = bool(_get(config, "qkv_bias", True)), False
        else:
            qkv_bias, o_bias = attention_bias, attention_bias
        moe_layers: tuple[int, ...] = ()
        num_experts = int(_get(config, "num_experts", 0)) if model_type in moe else 0
        if num_experts:
            step = int(_get(config, "decoder_sparse_step", 1))
            only_dense = set(_get(config, "mlp_only_layers", ()))
            moe_layers = tuple(i for i in range(layers) if i not in only_dense and (i + 1) % step == 0)
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(_get(config, "num_key_value_heads", heads)),
            head_dim=int(_get(config, "head_dim", hidden // heads)),
            intermediate_size=int(_get(config, "intermediate_size")),
            vocab_size=int(_get(config, "vocab_size")),
            num_hidden_layers=layers,
            tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(_get(config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            num_experts=num_experts,
            moe_intermediate_size=int(_get(config, "moe_intermediate_size", 0)) if num_experts else 0,
            moe_layers=moe_layers,
            shared_expert_intermediate_size=(
                int(_get(config, "shared_expert_intermediate_size", 0)) if model_type == "qwen2_moe" else 0
            ),
        )


@dataclass(frozen=True)
class CanonicalSlot:
    """One canonical tensor on one rank: ``fused[fused_name][index]`` is its view, and ``boxes``
    are the pieces of the global tensor inside that view as (global offset, shape, offset in
    the view). Most views are exactly one box at offset zero; a rank may hold none (a vocab
    shard made only of padding) or several (stacked experts: gate and up parts)."""

    name: str
    global_shape: tuple[int, ...]
    fused_name: str
    index: Index
    boxes: tuple[Box, ...]


def _divide(value: int, by: int, what: str, by_what: str = "tp_size") -> int:
    if value % by:
        raise ValueError(f"{what}={value} is not divisible by {by_what}={by}")
    return value // by


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position, first id, length) of runs of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for k, e in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == e:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((k, e, 1))
    return out


class FusedLayout:
    """The fused tensors of TP rank ``tp_rank`` of a ``tp_size`` vLLM engine, as canonical views.

    ``config``: a `DecoderConfig`, a transformers config or its dict. ``expert_parallel``,
    ``expert_placement`` and ``expert_names`` as the module docstring describes;
    ``vocab_padding`` is vLLM's ``padding_size`` (64).
    """

    def __init__(
        self,
        config: DecoderConfig | Any,
        tp_size: int,
        tp_rank: int,
        *,
        expert_parallel: bool = False,
        expert_placement: str = "linear",
        expert_names: str = "per_expert",
        vocab_padding: int = VOCAB_PADDING,
    ) -> None:
        cfg = config if isinstance(config, DecoderConfig) else DecoderConfig.from_hf(config)
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
        if expert_placement not in ("linear", "round_robin"):
            raise ValueError(f"expert_placement must be 'linear' or 'round_robin', got {expert_placement!r}")
        if expert_names not in ("per_expert", "stacked"):
            raise ValueError(f"expert_names must be 'per_expert' or 'stacked', got {expert_names!r}")
        self.config, self.tp_size, self.tp_rank = cfg, tp_size, tp_rank
        self.expert_parallel, self.expert_placement, self.expert_names = (
            expert_parallel,
            expert_placement,
            expert_names,
        )
        self.vocab_padding = vocab_padding
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._padding: dict[str, int] = {}  # fused name -> first padding row
        self.slots: tuple[CanonicalSlot, ...] = tuple(self._build())

    # ---- per-rank arithmetic ------------------------------------------------------------------
    @property
    def tied(self) -> dict[str, str]:
        """Canonical names that are not separate tensors -> the name that holds their data."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    def kv_heads(self) -> tuple[int, int]:
        """(first KV head, KV heads) on this rank; a KV head is replicated on ``tp //
        num_kv_heads`` ranks when TP exceeds the KV head count."""
        kv, tp, r = self.config.num_key_value_heads, self.tp_size, self.tp_rank
        if tp >= kv:
            return r // _divide(tp, kv, "tp_size", "num_key_value_heads"), 1
        local = _divide(kv, tp, "num_key_value_heads")
        return r * local, local

    def vocab_rows(self) -> tuple[int, int, int]:
        """(first global row, valid rows, rows per rank) of the vocab-parallel tensors."""
        padded = pad_vocab_size(self.config.vocab_size, self.vocab_padding)
        per = _divide(padded, self.tp_size, f"padded vocab of vocab_size {self.config.vocab_size}")
        start = self.tp_rank * per
        return start, max(0, min(per, self.config.vocab_size - start)), per

    def local_experts(self) -> list[int]:
        """Global ids of the experts on this rank, in local order (vLLM's expert map)."""
        num, ep, r = self.config.num_experts, self.tp_size, self.tp_rank
        if not self.expert_parallel or ep == 1:
            return list(range(num))
        if self.expert_placement == "round_robin":
            return list(range(r, num, ep))
        base, extra = divmod(num, ep)
        start = r * base + min(r, extra)
        return list(range(start, start + base + (1 if r < extra else 0)))

    # ---- the slot table -----------------------------------------------------------------------
    def _fused(self, name: str, shape: tuple[int, ...]) -> str:
        self._shapes[name] = shape
        return name

    def _whole(self, name: str, shape: tuple[int, ...]) -> CanonicalSlot:
        """A tensor every rank holds whole (norms, router, biases of row-parallel layers)."""
        zero = (0,) * len(shape)
        return CanonicalSlot(name, shape, self._fused(name, shape), (), ((zero, shape, zero),))

    def _vocab(self, canonical: str, fused: str) -> CanonicalSlot:
        hidden = self.config.hidden_size
        start, rows, per = self.vocab_rows()
        self._fused(fused, (per, hidden))
        self._padding[fused] = rows
        boxes = (((start, 0), (rows, hidden), (0, 0)),) if rows else ()
        return CanonicalSlot(canonical, (self.config.vocab_size, hidden), fused, (slice(0, rows),), boxes)

    def _column_parts(
        self, fused: str, parts: Sequence[tuple[str, int, int, int]], trailing: tuple[int, ...]
    ) -> list[CanonicalSlot]:
        """Row-stacked parts of a column-parallel fused tensor: (canonical name, global rows,
        first global row held, rows held) each; ``trailing`` is the shape after dim 0."""
        total = sum(n for _, _, _, n in parts)
        self._fused(fused, (total, *trailing))
        out, row, zeros = [], 0, (0,) * len(trailing)
        for name, global_rows, start, n in parts:
            box = ((start, *zeros), (n, *trailing), (0, *zeros))
            out.append(CanonicalSlot(name, (global_rows, *trailing), fused, (slice(row, row + n),), (box,)))
            row += n
        return out

    def _row_parallel(self, name: str, rows: int, cols: int, start: int, n: int) -> CanonicalSlot:
        fused = self._fused(name, (rows, n))
        return CanonicalSlot(name, (rows, cols), fused, (), (((0, start), (rows, n), (0, 0)),))

    def _dense_mlp(self, prefix: str, inter: int, bias: bool) -> list[CanonicalSlot]:
        hidden, tp, r = self.config.hidden_size, self.tp_size, self.tp_rank
        ir = _divide(inter, tp, f"{prefix} intermediate size")
        parts = [
            (f"{prefix}.gate_proj.weight", inter, r * ir, ir),
            (f"{prefix}.up_proj.weight", inter, r * ir, ir),
        ]
        out = self._column_parts(f"{prefix}.gate_up_proj.weight", parts, (hidden,))
        if bias:
            parts = [
                (f"{prefix}.gate_proj.bias", inter, r * ir, ir),
                (f"{prefix}.up_proj.bias", inter, r * ir, ir),
            ]
            out += self._column_parts(f"{prefix}.gate_up_proj.bias", parts, ())
        out.append(self._row_parallel(f"{prefix}.down_proj.weight", hidden, inter, r * ir, ir))
        if bias:
            out.append(self._whole(f"{prefix}.down_proj.bias", (hidden,)))
        return out

    def _experts(self, prefix: str) -> list[CanonicalSlot]:
        cfg = self.config
        hidden, inter, num = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        split = 1 if self.expert_parallel else self.tp_size
        er = 0 if self.expert_parallel else self.tp_rank
        ir = _divide(inter, split, "moe_intermediate_size")
        ids = self.local_experts()
        w13 = self._fused(f"{prefix}.experts.w13_weight", (len(ids), 2 * ir, hidden))
        w2 = self._fused(f"{prefix}.experts.w2_weight", (len(ids), hidden, ir))
        if self.expert_names == "stacked":
            gate_up, down = [], []
            for k, e, n in _runs(ids):
                gate_up.append(((e, er * ir, 0), (n, ir, hidden), (k, 0, 0)))
                gate_up.append(((e, inter + er * ir, 0), (n, ir, hidden), (k, ir, 0)))
                down.append(((e, 0, er * ir), (n, hidden, ir), (k, 0, 0)))
            return [
                CanonicalSlot(
                    f"{prefix}.experts.gate_up_proj", (num, 2 * inter, hidden), w13, (), tuple(gate_up)
                ),
                CanonicalSlot(f"{prefix}.experts.down_proj", (num, hidden, inter), w2, (), tuple(down)),
            ]
        out = []
        for k, e in enumerate(ids):
            p = f"{prefix}.experts.{e}"
            box = ((er * ir, 0), (ir, hidden), (0, 0))
            out.append(
                CanonicalSlot(f"{p}.gate_proj.weight", (inter, hidden), w13, (k, slice(0, ir)), (box,))
            )
            out.append(
                CanonicalSlot(f"{p}.up_proj.weight", (inter, hidden), w13, (k, slice(ir, 2 * ir)), (box,))
            )
            down_box = ((0, er * ir), (hidden, ir), (0, 0))
            out.append(CanonicalSlot(f"{p}.down_proj.weight", (hidden, inter), w2, (k,), (down_box,)))
        return out

    def _layer(self, i: int) -> list[CanonicalSlot]:
        cfg, tp, r = self.config, self.tp_size, self.tp_rank
        hidden, hd = cfg.hidden_size, cfg.head_dim
        p = f"model.layers.{i}"
        q_rows = _divide(cfg.num_attention_heads, tp, "num_attention_heads") * hd
        kv0, kv_n = self.kv_heads()
        q_full, kv_full = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        out = [self._whole(f"{p}.input_layernorm.weight", (hidden,))]
        for kind, trailing in (("weight", (hidden,)), ("bias", ())):
            if kind == "bias" and not cfg.qkv_bias:
                continue
            a = f"{p}.self_attn"
            parts = [
                (f"{a}.q_proj.{kind}", q_full, r * q_rows, q_rows),
                (f"{a}.k_proj.{kind}", kv_full, kv0 * hd, kv_n * hd),
                (f"{a}.v_proj.{kind}", kv_full, kv0 * hd, kv_n * hd),
            ]
            out += self._column_parts(f"{a}.qkv_proj.{kind}", parts, trailing)
        out.append(self._row_parallel(f"{p}.self_attn.o_proj.weight", hidden, q_full, r * q_rows, q_rows))
        if cfg.o_proj_bias:
            out.append(self._whole(f"{p}.self_attn.o_proj.bias", (hidden,)))
        if cfg.qk_norm:
            out += [
                self._whole(f"{p}.self_attn.q_norm.weight", (hd,)),
                self._whole(f"{p}.self_attn.k_norm.weight", (hd,)),
            ]
        if i in cfg.moe_layers:
            out.append(self._whole(f"{p}.mlp.gate.weight", (cfg.num_experts, hidden)))
            out += self._experts(f"{p}.mlp")
            if cfg.shared_expert_intermediate_size:
                out += self._dense_mlp(f"{p}.mlp.shared_expert", cfg.shared_expert_intermediate_size, False)
                out.append(self._whole(f"{p}.mlp.shared_expert_gate.weight", (1, hidden)))
        else:
            out += self._dense_mlp(f"{p}.mlp", cfg.intermediate_size, cfg.mlp_bias)
        out.append(self._whole(f"{p}.post_attention_layernorm.weight", (hidden,)))
        return out

    def _build(self) -> list[CanonicalSlot]:
        cfg = self.config
        if cfg.moe_layers and (cfg.num_experts < 1 or cfg.moe_intermediate_size < 1):
            raise ValueError("moe_layers need num_experts and moe_intermediate_size")
        out = [self._vocab("model.embed_tokens.weight", "model.embed_tokens.weight")]
        for i in range(cfg.num_hidden_layers):
            out += self._layer(i)
        out.append(self._whole("model.norm.weight", (cfg.hidden_size,)))
        if not cfg.tie_word_embeddings:
            out.append(self._vocab("lm_head.weight", "lm_head.weight"))
        return out

    # ---- public face --------------------------------------------------------------------------
    def fused_shapes(self) -> dict[str, tuple[int, ...]]:
        """vLLM name -> local shape of every fused tensor of this rank, in model order (a tied
        lm_head is not listed: vLLM shares the embedding's parameter)."""
        return dict(self._shapes)

    def allocate(
        self, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        """Uninitialised fused tensors for this rank (vLLM names), with the vocabulary padding
        rows zeroed as vLLM's weight loader leaves them."""
        out = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in self._shapes.items()}
        for name, rows in self._padding.items():
            out[name][rows:].zero_()
        return out

    def views(self, fused: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical name -> view into ``fused`` (vLLM name -> this rank's tensor). Views share
        storage with the fused tensors. Raises KeyError for a missing fused tensor, ValueError
        for a wrong shape, or for a separate ``lm_head.weight`` when the embeddings are tied."""
        for name, shape in self._shapes.items():
            if name not in fused:
                raise KeyError(f"fused tensor {name!r} (shape {shape}) missing on tp rank {self.tp_rank}")
            if tuple(fused[name].shape) != shape:
                raise ValueError(
                    f"fused tensor {name!r} on tp rank {self.tp_rank} has shape {tuple(fused[name].shape)}, "
                    f"the layout expects {shape}"
                )
        if self.tied and "lm_head.weight" in fused:
            head, embed = fused["lm_head.weight"], fused["model.embed_tokens.weight"]
            if head.data_ptr() != embed.data_ptr() or head.shape != embed.shape:
                raise ValueError("tie_word_embeddings is set but lm_head.weight is a separate tensor")
        return {s.name: fused[s.fused_name][s.index] for s in self.slots}

    def metas(self, dtype: str | torch.dtype, rank: int | None = None) -> list[ParameterMeta]:
        """This rank's `ParameterMeta` list in model order (``rank`` defaults to ``tp_rank``;
        give the rank inside the engine). ``local_offset`` is set where a box does not start at
        the view's origin."""
        rank = self.tp_rank if rank is None else rank
        dtype_name = str(dtype).removeprefix("torch.")
        out = []
        for s in self.slots:
            shards = tuple(ShardMeta(rank, go, shape, lo if any(lo) else None) for go, shape, lo in s.boxes)
            out.append(ParameterMeta(s.name, s.global_shape, dtype_name, shards))
        return out
