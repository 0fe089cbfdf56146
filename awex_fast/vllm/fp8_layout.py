"""Block-FP8 vLLM models fed from a float trainer: the receiver-side route.

An FP8-serialized vLLM model (``quantization_config: {"quant_method": "fp8", "weight_block_size":
[bn, bk]}``) loads every quantized linear weight as two checkpoint tensors: ``X.weight`` in e4m3
and ``X.weight_scale_inv`` (float32, one per block). The trainer offers ``X.weight`` in its own
float dtype and no scales, so a plain layout recording finds the scale parameters uncovered.
`fp8_targets` recognises exactly those weights (the checkpoint names whose copies land in the
sibling ``weight`` of an uncovered ``weight_scale_inv``), and `offer_with_scales` records the
layout again as the FP8 checkpoint would be loaded.

Each worker receives its boxes of ``X.weight`` in the trainer's dtype (never the e4m3 bytes: the
trainer does not quantize on this route) and quantizes them itself (`quantize_boxes`) with vLLM's
block rule (`awex_fast.transfer.fp8`) before vLLM's loaders take the e4m3 weight and the scales.
vLLM's TP slices of a block-FP8 weight are whole blocks (its loaders refuse anything else), so
every block a worker keeps is whole on that worker and its scale is exact: the result is bit for
bit what ``per_block_cast_to_fp8`` makes of the full tensor. A box that cuts a block is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from awex_fast.transfer.fp8 import FP8_DTYPE, BlockGrid, piece_amax, quantize_piece, scales_from_amax
from awex_fast.vllm.layout import LayoutError, LoadLayout

__all__ = ["SCALE_SUFFIX", "Fp8Target", "block_size", "fp8_targets", "offer_with_scales", "quantize_boxes"]

SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Fp8Target:
    """One checkpoint weight the model holds in block FP8: its name, its scale's name, its grid."""

    name: str
    scale_name: str
    grid: BlockGrid


def block_size(vllm_config: object) -> tuple[int, int] | None:
    """The model's FP8 ``weight_block_size``, or None when it is not an FP8 model. An FP8 model
    without blocks (per-tensor or per-channel scales) is refused: its scales are not what this
    route computes."""
    quant = getattr(vllm_config, "quant_config", None)
    if quant is None or type(quant).__name__ != "Fp8Config":
        return None
    block = getattr(quant, "weight_block_size", None)
    if not block or len(block) != 2:
        raise LayoutError(f"awex_fast updates block-quantized FP8 models only (weight_block_size [bn, bk]); "
                          f"this model's FP8 config has weight_block_size {block!r}")
    if getattr(quant, "is_checkpoint_fp8_serialized", True) is False:
        return None  # online quantization: the checkpoint is float, vLLM quantizes at load
    return int(block[0]), int(block[1])


Offered = Sequence[tuple[str, tuple[int, ...], torch.dtype]]  # (checkpoint name, shape, dtype)
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)


def fp8_targets(layout: LoadLayout, params: set[str], offered: Offered,
                block: tuple[int, int]) -> dict[str, Fp8Target]:
    """From a recording of the trainer's names (without coverage), the checkpoint weights that
    land in a parameter whose ``weight_scale_inv`` nothing fills: those vLLM holds in FP8."""
    uncovered_scales = {p for p in params if p.endswith("weight" + SCALE_SUFFIX)}
    filled = {c.param for copies in layout.copies.values() for c in copies}
    weights = {p.removesuffix(SCALE_SUFFIX) for p in uncovered_scales - filled}
    shapes = {n: s for n, s, _ in offered}
    out = {}
    for name, copies in layout.copies.items():
        if any(c.param in weights for c in copies):
            shape = shapes[name]
            if len(shape) != 2:
                raise LayoutError(f"checkpoint tensor {name!r} lands in a block-FP8 weight but is "
                                  f"{len(shape)}-D")
            out[name] = Fp8Target(name, name + SCALE_SUFFIX, BlockGrid(name, (shape[0], shape[1]), block))
    return out


def offer_with_scales(offered: Offered, targets: dict[str, Fp8Target]) -> list[tuple[str, tuple[int, ...],
                                                                                 torch.dtype]]:
    """The trainer's names as an FP8 checkpoint holds them: each target in e4m3, followed by its
    float32 scale tensor."""
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for name, shape, dtype in offered:
        target = targets.get(name)
        if target is None:
            out.append((name, shape, dtype))
        else:
            out += [(name, shape, FP8_DTYPE), (target.scale_name, target.grid.grid, torch.float32)]
    return out


def quantize_boxes(target: Fp8Target, staged: torch.Tensor,
                   boxes: Sequence[Box]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scales), both full checkpoint shape, of which the blocks of
    ``boxes`` (this worker's, received into ``staged``) are filled: what vLLM's loaders read."""
    grid = target.grid
    bn, bk = grid.block
    weight = torch.zeros(grid.shape, dtype=FP8_DTYPE, device=staged.device)
    scales = torch.ones(grid.grid, dtype=torch.float32, device=staged.device)
    for offset, shape in boxes:
        for d, (o, n, b) in enumerate(zip(offset, shape, (bn, bk), strict=True)):
            if o % b or ((o + n) % b and o + n != grid.shape[d]):
                raise LayoutError(f"{target.name}: this worker's box {tuple(offset)}+{tuple(shape)} cuts a "
                                  f"{bn}x{bk} block, so it cannot quantize it alone")
        piece = staged[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]]
        (i, j), amax = piece_amax(piece, offset, grid)
        block_scales = scales_from_amax(amax)
        scales[i:i + amax.shape[0], j:j + amax.shape[1]] = block_scales
        weight[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]] = \
            quantize_piece(piece, offset, grid, scales)
    return weight, scales
