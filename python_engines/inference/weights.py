"""Canonical (Hugging Face) views into the decoder's fused per-rank tensors, and weight loading.

Why views: weight sync and checkpoint loading both speak canonical names
(``model.layers.3.self_attn.k_proj.weight``) and global boxes, while the model holds vLLM's
fused tensors. Each `CanonicalView` is a strided *view* of the fused parameter, so writing into
it (``view.copy_(...)``, an awex_fast unpack) changes the real weight; there is no staging copy.

Boxes per TP rank ``r`` (sizes from `python_engines.inference.tp.TPShapes`):

============================  =====================================  =============================
canonical name                global box                             local view
============================  =====================================  =============================
``q_proj.weight`` / bias      rows ``[r*q, (r+1)*q)``                ``qkv_proj[0:q]``
``k_proj`` / ``v_proj``       rows of KV heads ``kv_head_start..``   ``qkv_proj[q:q+kv]``, ``[q+kv:]``
``o_proj.weight``             columns ``[r*q, (r+1)*q)``             ``o_proj.weight``
``gate_proj`` / ``up_proj``   rows ``[r*i, (r+1)*i)``                ``gate_up_proj[0:i]``, ``[i:]``
``down_proj.weight``          columns ``[r*i, (r+1)*i)``             ``down_proj.weight``
``embed_tokens`` / lm_head    rows ``[r*V_r, (r+1)*V_r) & [0, V)``   leading rows (padding: none)
norms, ``o_proj.bias``        whole tensor (replicated)              the parameter
============================  =====================================  =============================

When TP exceeds the KV head count, ranks ``r`` with the same ``r // (tp // num_kv_heads)`` hold
the same KV head: replicas of one box, as the planner expects.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from awex_fast.meta import ParameterMeta, ShardMeta
from python_engines.inference.model import Transformer

__all__ = ["CanonicalView", "canonical_views", "init_random_weights", "load_hf_weights", "weight_metas"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@dataclass(frozen=True)
class CanonicalView:
    """One rank's piece of a canonical tensor: ``view`` holds the box at ``global_offset``."""

    name: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    view: torch.Tensor

    def global_slices(self) -> tuple[slice, ...]:
        """Slices selecting this piece's box out of the full tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.global_offset, self.view.shape, strict=True))


def canonical_views(model: Transformer) -> list[CanonicalView]:
    """Every canonical piece this rank holds, in checkpoint order (embedding, layers, norm, head)."""
    a, s = model.args, model.shapes
    r, hd, H = s.tp.rank, a.head_dim, a.hidden_size
    q, kv, inter = s.q_size, s.kv_size, s.intermediate_local
    q_full, kv_full = a.num_heads * hd, a.num_kv_heads * hd
    kv0 = s.kv_head_start * hd
    out: list[CanonicalView] = []

    def vocab_rows(name: str, weight: torch.Tensor) -> None:
        rows = max(0, min(a.vocab_size - s.vocab_start, s.vocab_local))
        if rows:
            out.append(CanonicalView(name, (a.vocab_size, H), (s.vocab_start, 0), weight[:rows]))

    vocab_rows("model.embed_tokens.weight", model.model.embed_tokens.weight)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        w = attn.qkv_proj.weight
        out += [
            CanonicalView(f"{p}.input_layernorm.weight", (H,), (0,), layer.input_layernorm.weight),
            CanonicalView(f"{p}.self_attn.q_proj.weight", (q_full, H), (r * q, 0), w[:q]),
            CanonicalView(f"{p}.self_attn.k_proj.weight", (kv_full, H), (kv0, 0), w[q : q + kv]),
            CanonicalView(f"{p}.self_attn.v_proj.weight", (kv_full, H), (kv0, 0), w[q + kv :]),
        ]
        if a.qkv_bias:
            b = attn.qkv_proj.bias
            out += [
                CanonicalView(f"{p}.self_attn.q_proj.bias", (q_full,), (r * q,), b[:q]),
                CanonicalView(f"{p}.self_attn.k_proj.bias", (kv_full,), (kv0,), b[q : q + kv]),
                CanonicalView(f"{p}.self_attn.v_proj.bias", (kv_full,), (kv0,), b[q + kv :]),
            ]
        out.append(CanonicalView(f"{p}.self_attn.o_proj.weight", (H, q_full), (0, r * q), attn.o_proj.weight))
        if a.o_bias:
            out.append(CanonicalView(f"{p}.self_attn.o_proj.bias", (H,), (0,), attn.o_proj.bias))
        if a.qk_norm:
            out += [
                CanonicalView(f"{p}.self_attn.q_norm.weight", (hd,), (0,), attn.q_norm.weight),
                CanonicalView(f"{p}.self_attn.k_norm.weight", (hd,), (0,), attn.k_norm.weight),
            ]
        gu = mlp.gate_up_proj.weight
        full_i = a.intermediate_size
        out += [
            CanonicalView(
                f"{p}.post_attention_layernorm.weight", (H,), (0,), layer.post_attention_layernorm.weight
            ),
            CanonicalView(f"{p}.mlp.gate_proj.weight", (full_i, H), (r * inter, 0), gu[:inter]),
            CanonicalView(f"{p}.mlp.up_proj.weight", (full_i, H), (r * inter, 0), gu[inter:]),
            CanonicalView(f"{p}.mlp.down_proj.weight", (H, full_i), (0, r * inter), mlp.down_proj.weight),
        ]
    out.append(CanonicalView("model.norm.weight", (H,), (0,), model.model.norm.weight))
    if not a.tie_word_embeddings:
        vocab_rows("lm_head.weight", model.lm_head.weight)
    return out


def weight_metas(model: Transformer, rank: int | None = None) -> list[ParameterMeta]:
    """awex_fast metadata of this rank's pieces (``rank`` default: the TP rank)."""
    rank = model.shapes.tp.rank if rank is None else rank
    dtype = str(model.model.norm.weight.dtype).removeprefix("torch.")
    return [
        ParameterMeta(v.name, v.global_shape, dtype, [ShardMeta(rank, v.global_offset, tuple(v.view.shape))])
        for v in canonical_views(model)
    ]


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """Canonical name -> safetensors file holding it, for an HF checkpoint directory."""
    if (path / _INDEX).exists():
        weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    if (path / _SINGLE).exists():
        with safe_open(str(path / _SINGLE), framework="pt") as f:
            return dict.fromkeys(f.keys(), path / _SINGLE)
    raise FileNotFoundError(f"no {_SINGLE} or {_INDEX} in checkpoint directory {path}")


def _by_file(
    views: list[CanonicalView], files: dict[str, Path]
) -> Iterator[tuple[Path, list[CanonicalView]]]:
    groups: dict[Path, list[CanonicalView]] = {}
    for v in views:
        groups.setdefault(files[v.name], []).append(v)
    yield from groups.items()


@torch.no_grad()
def load_hf_weights(model: Transformer, path: str | Path) -> int:
    """Copy this rank's boxes of the HF safetensors checkpoint in ``path`` into the model, reading
    only those boxes (``safe_open(...).get_slice``). Returns the bytes read.

    Raises KeyError listing canonical names the checkpoint lacks and ValueError naming a tensor
    whose shape differs from the model's. A failure part-way leaves the model partly written;
    the server treats that as a failed update.
    """
    directory = Path(path)
    files = _checkpoint_files(directory)
    views = canonical_views(model)
    missing = sorted({v.name for v in views} - set(files))
    if missing:
        raise KeyError(f"checkpoint {directory} lacks {len(missing)} tensor(s): {missing[:6]}")
    nbytes = 0
    for file, group in _by_file(views, files):
        with safe_open(str(file), framework="pt") as f:
            for v in group:
                piece = f.get_slice(v.name)
                shape = tuple(piece.get_shape())
                if shape != v.global_shape:
                    raise ValueError(
                        f"checkpoint tensor {v.name!r} in {file.name} has shape {shape}, "
                        f"the model expects {v.global_shape}"
                    )
                data = piece[v.global_slices()]
                v.view.copy_(data)
                nbytes += data.numel() * data.element_size()
    return nbytes


@torch.no_grad()
def init_random_weights(model: Transformer, seed: int, initializer_range: float = 0.02) -> None:
    """Initialise every canonical tensor as transformers does (normal(0, initializer_range)
    matrices, zero biases, unit norms), generated whole from ``seed`` and the name so that every TP rank of
    any TP size holds boxes of the same global tensors."""
    gen = torch.Generator()
    for v in canonical_views(model):
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(v.name.encode()))  # per name: rank-independent
        if v.name.endswith("norm.weight"):
            full = torch.ones(v.global_shape)
        elif v.name.endswith(".bias"):
            full = torch.zeros(v.global_shape)
        else:
            full = torch.empty(v.global_shape).normal_(0.0, initializer_range, generator=gen)
        v.view.copy_(full[v.global_slices()])
