"""Block-FP8 quantized on the trainer ranks: e4m3 bytes and scales on the wire, nothing gathered.

When the workers of a block-FP8 vLLM model report the weights they hold in FP8 (and their block
size) at the first join, the trainer wraps its source in a `QuantizingSource` and joins again:
every such weight is then offered as e4m3 (the same pieces as before) plus its
``weight_scale_inv`` tensor, so the workers load it as an FP8 checkpoint and no byte of it
travels wider than one.

Each round every rank takes the block amax of its own pieces (`awex_fast.transfer.fp8`); one MAX
all-reduce over the trainer ranks of those tiny per-block tensors gives every rank the amax of
every whole block, even of blocks its shard cuts (FSDP2 row shards of 171 rows, TP column
shards); every piece is then quantized with its whole block's scale, so what arrives is bit for
bit ``per_block_cast_to_fp8`` of the full tensor. A block's scale is offered by the ranks whose
pieces hold its first element (one rank, or identical replicas).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from awex_fast.meta import ParameterMeta, ShardMeta
from awex_fast.transfer.fp8 import (
    FP8_DTYPE,
    BlockGrid,
    QuantizationError,
    piece_amax,
    quantize_piece_into,
    scales_from_amax,
)
from awex_fast.vllm.fp8_layout import SCALE_SUFFIX

__all__ = ["QuantizingSource"]


class QuantizingSource:
    """This rank's tensors and metadata with every weight of ``targets`` (name -> block size)
    as e4m3 + scales (module docstring). ``base_metas`` / ``base_tensors``: this rank's pieces
    and local tensors as they are; ``reduce_max``: an in-place MAX all-reduce over the trainer
    ranks (identity for one rank). `refresh` (collective) must run every round before sending."""

    def __init__(self, base_metas: Callable[[], Sequence[ParameterMeta]],
                 base_tensors: Callable[[], Mapping[str, torch.Tensor]],
                 targets: Mapping[str, tuple[int, int]], rank: int,
                 reduce_max: Callable[[torch.Tensor], None]) -> None:
        self.base_metas, self.base_tensors = base_metas, base_tensors
        self.targets, self.rank, self.reduce_max = dict(targets), rank, reduce_max
        self._tensors: dict[str, torch.Tensor] = {}

    def _grids(self, metas: Sequence[ParameterMeta]) -> dict[str, BlockGrid]:
        by_name = {m.name: m for m in metas}
        # sorted: every rank lays the all-reduced buffer out in the same order
        return {n: BlockGrid(n, tuple(by_name[n].global_shape), self.targets[n])  # type: ignore[arg-type]
                for n in sorted(self.targets) if n in by_name}

    def metas(self) -> list[ParameterMeta]:
        """This rank's metadata: targets as e4m3, each followed by the scale blocks it offers."""
        base = list(self.base_metas())
        grids = self._grids(base)
        out = []
        for m in base:
            grid = grids.get(m.name)
            if grid is None:
                out.append(m)
                continue
            pieces = m.pieces_for_rank(self.rank)
            out.append(ParameterMeta(m.name, m.global_shape, "float8_e4m3fn", tuple(pieces)))
            boxes = [b for b in (_scale_box(p, grid) for p in pieces) if b is not None]
            scale = [ShardMeta(self.rank, off, shape, off) for off, shape in dict.fromkeys(boxes)]
            out.append(ParameterMeta(m.name + SCALE_SUFFIX, grid.grid, "float32", tuple(scale)))
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of the last `refresh`."""
        return self._tensors

    def refresh(self) -> None:
        """Quantize this round's weights (collective: the amax all-reduce, which every rank joins
        even when its own pieces hold a non-finite value; that rank raises after it)."""
        base, local = list(self.base_metas()), dict(self.base_tensors())
        grids = self._grids(base)
        sizes = [math.prod(g.grid) for g in grids.values()]
        amax = torch.zeros(sum(sizes), dtype=torch.float32)
        views = dict(zip(grids, torch.split(amax, sizes), strict=True))
        pieces = {m.name: m.pieces_for_rank(self.rank) for m in base if m.name in grids}
        error: QuantizationError | None = None
        try:
            for name, grid in grids.items():
                mine = views[name].view(grid.grid)
                for p in pieces[name]:
                    (i, j), part = piece_amax(_region(local[name], p), p.global_offset, grid)
                    window = mine[i:i + part.shape[0], j:j + part.shape[1]]
                    torch.maximum(window, part.cpu(), out=window)
        except QuantizationError as exc:
            error = exc
        self.reduce_max(amax)
        if error is not None:
            raise error
        out = {n: t for n, t in local.items() if n not in grids}
        for name, grid in grids.items():
            scales = scales_from_amax(views[name].view(grid.grid))
            src = local[name]
            q = self._buffer(name, src.shape, FP8_DTYPE, src.device)
            for p in pieces[name]:
                # fused: read the training dtype, write e4m3 straight into the send buffer
                quantize_piece_into(_region(q, p), _region(src, p), p.global_offset, grid, scales)
            s = self._buffer(name + SCALE_SUFFIX, scales.shape, torch.float32, src.device)
            s.copy_(scales)
            out[name], out[name + SCALE_SUFFIX] = q, s
        self._tensors = out

    def _buffer(self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Last round's tensor for ``name`` when it still fits (the executor then keeps its
        programs: same pointers), else a new one."""
        old = self._tensors.get(name)
        if old is not None and old.shape == shape and old.dtype == dtype and old.device == device:
            return old
        return torch.zeros(shape, dtype=dtype, device=device)


def _region(local: torch.Tensor, piece: ShardMeta) -> torch.Tensor:
    """The part of this rank's local tensor that holds ``piece``."""
    at = piece.local_offset or (0,) * len(piece.shape)
    return local[tuple(slice(o, o + n) for o, n in zip(at, piece.shape, strict=True))]


def _scale_box(piece: ShardMeta, grid: BlockGrid) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The blocks whose first element ``piece`` holds, as a box of the scale grid (None: none)."""
    (r0, c0), (rows, cols) = piece.global_offset, piece.shape
    bn, bk = grid.block
    i0, i1 = -(-r0 // bn), -(-(r0 + rows) // bn)
    j0, j1 = -(-c0 // bk), -(-(c0 + cols) // bk)
    if i1 <= i0 or j1 <= j0:
        return None
    return (i0, j0), (i1 - i0, j1 - j0)
