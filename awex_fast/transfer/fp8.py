"""Block FP8 quantization as vLLM does it, computed piece by piece where the pieces live.

vLLM's block-quantized FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 style, ``weight_block_size``
[128, 128]) hold each linear weight ``W`` [N, K] as ``weight`` in ``float8_e4m3fn`` and
``weight_scale_inv`` in float32, one scale per block, [ceil(N / 128), ceil(K / 128)]. vLLM's own
quantizer (``vllm.utils.deep_gemm.per_block_cast_to_fp8``) takes, per block, the largest
magnitude in float32 (``amax``), clamps it to at least 1e-4, divides by 448 (the largest e4m3
value) for the scale, and casts ``value * (1 / scale)`` (float32) to e4m3.

A trainer never holds ``W`` whole: its shards cut through blocks (FSDP2 row shards of 171 rows,
TP column shards). Max is exact, so each holder computes the amax of the part of each block it
holds (`piece_amax`), the holders combine those by max (`merge_amax`; on the trainer ranks a
MAX all-reduce of the tiny per-block tensor), and every piece is then quantized with the scale
the whole block has (`quantize_piece`): the pieces put together are bit for bit what the
quantizer makes of the full tensor, and nothing was gathered. `quantize_full` is the same on one
tensor (the receiver-side route, and a self-check).

A weight with a non-finite element has no scale: `QuantizationError` names the tensor and the
block before anything is produced from it.

The work is done by the native core's kernels (csrc/quant: CPU, vectorised and threaded; CUDA)
for float32 / bfloat16 / float16 pieces on the CPU or a CUDA device, bit for bit what the torch
expressions below compute (those stay as the fallback, for other dtypes or a core built without
the kernels, and as the tests' oracle). A CUDA kernel serves results only after it has passed
its self-check on that device (`awex_fast.transfer.cuda_selfcheck`; the checks are
`_check_block_amax` and `_check_quantize` at the end of this module).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from awex_fast.transfer import cuda_selfcheck as sc

__all__ = ["AMAX_FLOOR", "FP8_DTYPE", "FP8_MAX", "BlockGrid", "QuantizationError", "merge_amax",
           "piece_amax", "quantize_full", "quantize_piece", "quantize_piece_into", "scales_from_amax"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
AMAX_FLOOR = 1e-4  # vLLM's clamp: an all-zero block still gets a finite, non-zero scale


class QuantizationError(ValueError):
    """A tensor cannot be block-quantized as asked (its layout, or a non-finite value); the
    message names the tensor and the block."""


@dataclass(frozen=True)
class BlockGrid:
    """The block grid of one 2-D tensor: ``shape`` [N, K] cut into ``block`` [bn, bk] blocks
    (the last row / column of blocks may be partial)."""

    name: str
    shape: tuple[int, int]
    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or len(self.block) != 2:
            raise QuantizationError(f"{self.name}: block FP8 needs a 2-D tensor and a 2-D block, got shape "
                                    f"{tuple(self.shape)} and block {tuple(self.block)}")
        if min(self.block) < 1 or min(self.shape) < 1:
            raise QuantizationError(f"{self.name}: shape {tuple(self.shape)} / block {tuple(self.block)} "
                                    "must be positive")

    @property
    def grid(self) -> tuple[int, int]:
        """(block rows, block columns): the shape of the scale tensor."""
        return (math.ceil(self.shape[0] / self.block[0]), math.ceil(self.shape[1] / self.block[1]))

    def blocks_of(self, offset: Sequence[int], shape: Sequence[int]) -> tuple[range, range]:
        """The block rows and columns a box ``[offset, offset + shape)`` of the tensor touches."""
        (r0, c0), (rows, cols) = offset, shape
        if rows < 1 or cols < 1 or r0 < 0 or c0 < 0 or r0 + rows > self.shape[0] or c0 + cols > self.shape[1]:
            raise QuantizationError(f"{self.name}: box {tuple(offset)}+{tuple(shape)} is outside "
                                    f"{tuple(self.shape)}")
        bn, bk = self.block
        return range(r0 // bn, (r0 + rows - 1) // bn + 1), range(c0 // bk, (c0 + cols - 1) // bk + 1)


def _check_piece(piece: torch.Tensor, offset: Sequence[int], grid: BlockGrid) -> tuple[range, range]:
    if piece.dim() != 2:
        raise QuantizationError(f"{grid.name}: a piece must be 2-D, got {tuple(piece.shape)}")
    if not piece.is_floating_point():
        raise QuantizationError(f"{grid.name}: pieces are quantized from a floating dtype, got {piece.dtype}")
    return grid.blocks_of(offset, piece.shape)


def piece_amax(piece: torch.Tensor, offset: Sequence[int],
               grid: BlockGrid) -> tuple[tuple[int, int], torch.Tensor]:
    """The largest magnitude (float32) of ``piece`` (the box of the tensor at ``offset``) in each
    block it touches: (first block (row, column), amax [block rows, block columns]). Blocks the
    piece only partly covers get the amax of that part; `merge_amax` combines the parts."""
    rows_b, cols_b = _check_piece(piece, offset, grid)
    quant = _native_for(piece)
    if quant is None:
        amax = _torch_amax(piece, offset, grid, rows_b, cols_b)
    else:
        device = _device_index(piece)
        if device >= 0:
            sc.ensure("block_amax", device)
        amax = torch.empty(len(rows_b), len(cols_b), dtype=torch.float32, device=piece.device)
        bad = _native_amax(quant, piece, offset, grid, amax)
        if device < 0:  # the CPU kernel names the first non-finite block itself
            if bad >= 0:
                _raise_non_finite(grid, rows_b.start + bad // len(cols_b), cols_b.start + bad % len(cols_b))
            return (rows_b.start, cols_b.start), amax
    if not bool(torch.isfinite(amax).all()):
        i, j = (int(x) for x in (~torch.isfinite(amax)).nonzero()[0])
        _raise_non_finite(grid, rows_b.start + i, cols_b.start + j)
    return (rows_b.start, cols_b.start), amax


def _raise_non_finite(grid: BlockGrid, i: int, j: int) -> None:
    raise QuantizationError(f"{grid.name}: block ({i}, {j}) holds a non-finite value; it has no FP8 scale")


def _torch_amax(piece: torch.Tensor, offset: Sequence[int], grid: BlockGrid,
                rows_b: range, cols_b: range) -> torch.Tensor:
    """`piece_amax`'s amax by torch ops (the fallback and the oracle); non-finite blocks get a
    non-finite amax."""
    bn, bk = grid.block
    (r0, c0), (rows, cols) = offset, piece.shape
    top, left = r0 - rows_b.start * bn, c0 - cols_b.start * bk
    # the piece laid out over whole blocks, zeros elsewhere (|x| >= 0, so zeros change no max)
    padded = torch.zeros(len(rows_b) * bn, len(cols_b) * bk, dtype=torch.float32, device=piece.device)
    padded[top:top + rows, left:left + cols] = piece.detach().abs().float()
    return padded.view(len(rows_b), bn, len(cols_b), bk).amax(dim=(1, 3))


def merge_amax(grid: BlockGrid, parts: Iterable[tuple[tuple[int, int], torch.Tensor]]) -> torch.Tensor:
    """The whole tensor's per-block amax from the parts' (`piece_amax`), by max (exact). Blocks no
    part touches stay 0 (their scale is then the floor's)."""
    full = torch.zeros(grid.grid, dtype=torch.float32)
    for (i, j), amax in parts:
        view = full[i:i + amax.shape[0], j:j + amax.shape[1]]
        torch.maximum(view, amax.to(full.device), out=view)
    return full


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """vLLM's scale (``weight_scale_inv``) of each block: max(amax, 1e-4) / 448, in float32."""
    return amax.float().clamp(AMAX_FLOOR) / FP8_MAX


def _check_scales(piece: torch.Tensor, offset: Sequence[int], grid: BlockGrid,
                  scales: torch.Tensor) -> None:
    rows_b, cols_b = _check_piece(piece, offset, grid)
    if scales.dim() != 2 or scales.shape[0] < rows_b.stop or scales.shape[1] < cols_b.stop:
        raise QuantizationError(f"{grid.name}: scales {tuple(scales.shape)} do not reach the blocks of box "
                                f"{tuple(offset)}+{tuple(piece.shape)} (grid {grid.grid})")


def quantize_piece(piece: torch.Tensor, offset: Sequence[int], grid: BlockGrid,
                   scales: torch.Tensor) -> torch.Tensor:
    """``piece`` (the box of the tensor at ``offset``) in e4m3, each element multiplied by the
    reciprocal of its block's scale in float32 (``scales``: the whole grid's, or any part of it
    that starts at block (0, 0)), as vLLM's quantizer does to the full tensor."""
    _check_scales(piece, offset, grid, scales)
    if _native_for(piece) is None:
        return _torch_quantize(piece, offset, grid, scales)
    out = torch.empty(piece.shape, dtype=torch.uint8, device=piece.device)
    quantize_piece_into(out, piece, offset, grid, scales)
    return out.view(FP8_DTYPE)


def quantize_piece_into(dst: torch.Tensor, piece: torch.Tensor, offset: Sequence[int], grid: BlockGrid,
                        scales: torch.Tensor) -> None:
    """`quantize_piece` written straight into ``dst`` (uint8 or float8_e4m3fn, the piece's shape
    and device, any strides: e.g. the piece's region of the e4m3 tensor that is sent), with no
    intermediate tensor. Same bytes, same checks and errors."""
    _check_scales(piece, offset, grid, scales)
    if dst.dtype not in (torch.uint8, FP8_DTYPE):
        raise QuantizationError(f"{grid.name}: the destination must be uint8 or {FP8_DTYPE}, got {dst.dtype}")
    if tuple(dst.shape) != tuple(piece.shape) or dst.device != piece.device:
        raise QuantizationError(f"{grid.name}: destination {tuple(dst.shape)} on {dst.device} does not match "
                                f"the piece {tuple(piece.shape)} on {piece.device}")
    if any(st == 0 and n > 1 for st, n in zip(dst.stride(), dst.shape, strict=True)):
        # the threads would race on the shared bytes (torch's copy_ refuses this too)
        raise QuantizationError(f"{grid.name}: the destination has a stride-0 dimension")
    quant = _native_for(piece)
    if quant is None:
        dst.view(torch.uint8).copy_(_torch_quantize(piece, offset, grid, scales).view(torch.uint8))
        return
    device = _device_index(piece)
    if device >= 0:
        sc.ensure("quantize_blocks", device)
    _native_quantize(quant, dst, piece, offset, grid, scales)


def _torch_quantize(piece: torch.Tensor, offset: Sequence[int], grid: BlockGrid,
                    scales: torch.Tensor) -> torch.Tensor:
    """`quantize_piece` by torch ops (the fallback and the oracle)."""
    bn, bk = grid.block
    (r0, c0), (rows, cols) = offset, piece.shape
    inverse = (1.0 / scales.float()).to(piece.device)
    block_row = torch.arange(r0, r0 + rows, device=piece.device) // bn
    block_col = torch.arange(c0, c0 + cols, device=piece.device) // bk
    return (piece.detach().float() * inverse[block_row][:, block_col]).to(FP8_DTYPE)


# --- the native kernels (csrc/quant) ---------------------------------------------------------

# dtype codes of csrc/copy/copy.h (kind | itemsize << 8) of the dtypes the kernels read.
_NATIVE_CODES = {torch.float32: 1 | 4 << 8, torch.bfloat16: 2 | 2 << 8, torch.float16: 3 | 2 << 8}


@functools.cache
def _native_quant(device_type: str) -> ModuleType | None:
    """The native core's quant module when it serves ``device_type`` tensors, else None."""
    try:
        from awex_fast._native import native
        core = native()
    except ImportError:  # no compiled core: the torch path
        return None
    quant = getattr(core, "quant", None)
    if device_type == "cuda" and not core.build_info()["cuda"]:
        return None
    return quant if device_type in ("cpu", "cuda") else None


def _native_for(piece: torch.Tensor) -> ModuleType | None:
    # Plain tensors only: a subclass (DTensor, a fake or functional tensor) has no data pointer
    # of its own to hand to a kernel, and torch's ops dispatch it correctly.
    if piece.dtype not in _NATIVE_CODES or type(piece) not in (torch.Tensor, torch.nn.Parameter):
        return None
    return _native_quant(piece.device.type)


def _device_index(t: torch.Tensor) -> int:
    if t.device.type == "cpu":
        return -1
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _stream(device: int) -> int:
    return 0 if device < 0 else int(torch.cuda.current_stream(device).cuda_stream)


def _piece_args(piece: torch.Tensor, offset: Sequence[int], grid: BlockGrid) -> tuple[int, ...]:
    (rows, cols), (sr, sc) = piece.shape, piece.stride()
    return (piece.data_ptr(), _NATIVE_CODES[piece.dtype], rows, cols, sr, sc, int(offset[0]), int(offset[1]),
            *grid.block)


def _native_amax(quant: ModuleType, piece: torch.Tensor, offset: Sequence[int], grid: BlockGrid,
                 out: torch.Tensor) -> int:
    """The kernel itself, no self-check (the self-checks call this): the amax of the blocks
    ``piece`` touches into ``out`` (float32, on its device); the CPU kernel returns the row-major
    index in ``out`` of the first non-finite block, or -1 (CUDA: always -1)."""
    device = _device_index(piece)
    return int(quant.block_amax(*_piece_args(piece, offset, grid), out.data_ptr(), out.stride(0),
                                out.stride(1), device, _stream(device)))


def _native_quantize(quant: ModuleType, dst: torch.Tensor, piece: torch.Tensor, offset: Sequence[int],
                     grid: BlockGrid, scales: torch.Tensor) -> None:
    """The kernel itself, no self-check (the self-checks call this): e4m3 bytes of ``piece``
    into ``dst`` with the reciprocals of ``scales`` (moved to float32 on the piece's device)."""
    device = _device_index(piece)
    s = scales.to(device=piece.device, dtype=torch.float32)
    quant.quantize_blocks(*_piece_args(piece, offset, grid), s.data_ptr(), s.stride(0), s.stride(1),
                          dst.data_ptr(), dst.stride(0), dst.stride(1), device, _stream(device))
    # A temporary `s` may be freed now: the caching allocator hands its memory out again only
    # to work queued after this kernel on the same stream.


def quantize_full(weight: torch.Tensor, name: str = "weight",
                  block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scales) of a whole 2-D tensor: what ``per_block_cast_to_fp8``
    returns for it."""
    grid = BlockGrid(name, (int(weight.shape[0]), int(weight.shape[1])), tuple(block))  # type: ignore[arg-type]
    scales = scales_from_amax(merge_amax(grid, [piece_amax(weight, (0, 0), grid)]))
    return quantize_piece(weight, (0, 0), grid, scales), scales


# --- the kernels' self-checks (awex_fast.transfer.cuda_selfcheck) ---------------------------

def _quant_cases(device: torch.device) -> list[tuple[str, torch.Tensor, tuple[int, int], BlockGrid]]:
    """(case, piece, offset, grid): pieces that cut blocks, partial last blocks, strided and
    transposed pieces, of each float dtype, with a few all-zero blocks."""
    gen = sc.sample_generator()
    w = sc.sample_floats((300, 260), gen)
    w = torch.where(torch.isfinite(w), w, torch.zeros(()))  # non-finite pieces are refused before
    w[:16, :24] = 0.0  # an all-zero block of the (16, 24) grid
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        full = w.to(dtype)
        full = torch.where(torch.isfinite(full), full, torch.zeros((), dtype=dtype)).to(device)
        for block in ((128, 128), (16, 24)):
            g, gt = BlockGrid("selfcheck", (300, 260), block), BlockGrid("selfcheck.T", (260, 300), block)
            cases += [(f"{dtype} whole, block {block}", full, (0, 0), g),
                      (f"{dtype} [37:250, 5:200], block {block}", full[37:250, 5:200], (37, 5), g),
                      (f"{dtype} [171:, 130:], block {block}", full[171:, 130:], (171, 130), g),
                      (f"{dtype} transposed [10:200], block {block}", full.t()[10:200], (10, 0), gt),
                      (f"{dtype} column-strided, block {block}", full[::2, ::3], (0, 0),
                       BlockGrid("selfcheck.s", (150, 87), block))]
    return cases


def _check_block_amax(device: torch.device) -> None:
    """Per-block amax against the torch expression, and a non-finite block seen as one."""
    quant = _native_quant(device.type)
    if quant is None:
        sc.fail("block_amax", device, "loading", "the native core has no quant kernels for this device")
    cases = _quant_cases(device)
    poisoned = cases[0][1].clone()
    poisoned[130, 200] = float("nan")
    poisoned[5, 140] = float("inf")
    cases.append(("float32 with a NaN and an inf", poisoned, (0, 0), cases[0][3]))
    for case, piece, offset, grid in cases:
        rows_b, cols_b = grid.blocks_of(offset, piece.shape)
        want = _torch_amax(piece, offset, grid, rows_b, cols_b)
        got = torch.full((len(rows_b), len(cols_b)), -1.0, dtype=torch.float32, device=device)
        _native_amax(quant, piece, offset, grid, got)
        finite = torch.isfinite(want)
        sc.compare("block_amax", device, case + " (non-finite blocks)", torch.isfinite(got), finite)
        sc.compare("block_amax", device, case, torch.where(finite, got, 0.0), torch.where(finite, want, 0.0))


def _check_quantize(device: torch.device) -> None:
    """e4m3 bytes against the torch expression, written into transposed destinations."""
    quant = _native_quant(device.type)
    if quant is None:
        sc.fail("quantize_blocks", device, "loading", "the native core has no quant kernels for this device")
    for case, piece, offset, grid in _quant_cases(device):
        rows_b, cols_b = grid.blocks_of(offset, piece.shape)
        amax = torch.zeros(grid.grid, dtype=torch.float32, device=device)
        amax[rows_b.start:rows_b.stop, cols_b.start:cols_b.stop] = _torch_amax(
            piece, offset, grid, rows_b, cols_b)
        scales = scales_from_amax(amax)
        want = _torch_quantize(piece, offset, grid, scales).view(torch.uint8)
        got = torch.full(piece.shape[::-1], 0x5A, dtype=torch.uint8, device=device).t()
        _native_quantize(quant, got, piece, offset, grid, scales)
        sc.compare("quantize_blocks", device, case, got, want)


sc.register("block_amax", _check_block_amax)
sc.register("quantize_blocks", _check_quantize)
