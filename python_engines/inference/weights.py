"""Canonical (Hugging Face) views into the decoder's fused per-rank tensors, and weight loading.

Why views: weight sync and checkpoint loading both speak canonical names
(``model.layers.3.self_attn.k_proj.weight``) and global boxes, while the model holds vLLM's
fused tensors. The table of which slice of which fused tensor holds which box is
`awex_fast.layouts.fused.FusedLayout` (vLLM's rules; its docstring has the table); the model's
parameters carry vLLM's names, so ``FusedLayout.views(dict(model.named_parameters()))`` gives the
canonical views, and the same layout gives the awex_fast metadata. Each view is a strided *view*
of the fused parameter: writing into it (``view.copy_(...)``, an awex_fast unpack) changes the
real weight, with no staging copy. Building the views checks every parameter's shape against the
layout, so the model and the layout cannot drift apart silently.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from awex_fast.layouts import FusedLayout
from awex_fast.meta import ParameterMeta
from python_engines.inference.model import Transformer

__all__ = ["CanonicalView", "canonical_views", "fused_layout", "init_random_weights", "load_hf_weights",
           "view_dict", "weight_metas"]

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


def fused_layout(model: Transformer) -> FusedLayout:
    """The `FusedLayout` of the model's TP rank (built once per model)."""
    layout = getattr(model, "_fused_layout", None)
    if layout is None:
        tp = model.shapes.tp
        layout = FusedLayout(model.args.hf_config, tp.size, tp.rank)
        model._fused_layout = layout
    return layout


def view_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Canonical name -> view into the model's fused parameters (a rank holding only vocabulary
    padding gets an empty view of the embedding)."""
    return fused_layout(model).views(dict(model.named_parameters()))


def canonical_views(model: Transformer) -> list[CanonicalView]:
    """Every canonical piece this rank holds, in checkpoint order (embedding, layers, norm, head)."""
    layout = fused_layout(model)
    views = view_dict(model)
    out = []
    for slot in layout.slots:
        view = views[slot.name]
        for offset, shape, local in slot.boxes:
            piece = view[tuple(slice(lo, lo + n) for lo, n in zip(local, shape, strict=True))]
            out.append(CanonicalView(slot.name, slot.global_shape, tuple(offset), piece))
    return out


def weight_metas(model: Transformer, rank: int | None = None) -> list[ParameterMeta]:
    """awex_fast metadata of this rank's pieces (``rank`` default: the TP rank)."""
    return fused_layout(model).metas(model.model.norm.weight.dtype, rank)


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
