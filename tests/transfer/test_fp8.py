"""Block FP8 quantization piece by piece (awex_fast.transfer.fp8) against vLLM's own quantizer,
``vllm.utils.deep_gemm.per_block_cast_to_fp8``, applied to the full tensor: for any tensor
(float32 or bfloat16, partial last blocks included) cut into any pieces (FSDP2-like uneven row
shards, TP column shards, both), quantizing each piece with the merged per-block amax and putting
the pieces together gives the oracle's e4m3 bytes and scales exactly."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from awex_fast.transfer.fp8 import (
    FP8_DTYPE,
    BlockGrid,
    QuantizationError,
    merge_amax,
    piece_amax,
    quantize_full,
    quantize_piece,
    scales_from_amax,
)

deep_gemm = pytest.importorskip("vllm.utils.deep_gemm", reason="the oracle is vLLM's quantizer")


def _oracle(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return deep_gemm.per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)


def _cuts(size: int, points: list[int]) -> list[tuple[int, int]]:
    """(start, length) of the pieces that cutting [0, size) at ``points`` makes."""
    edges = sorted({0, size, *(p for p in points if 0 < p < size)})
    return [(a, b - a) for a, b in itertools.pairwise(edges)]


def _quantized_by_pieces(w: torch.Tensor, row_cuts: list[int], col_cuts: list[int]):
    """Quantize ``w`` as its holders would: every piece's amax, merged, then each piece alone."""
    grid = BlockGrid("w", tuple(w.shape))
    pieces = [((r, c), w[r:r + nr, c:c + nc])
              for r, nr in _cuts(w.shape[0], row_cuts) for c, nc in _cuts(w.shape[1], col_cuts)]
    scales = scales_from_amax(merge_amax(grid, [piece_amax(p, off, grid) for off, p in pieces]))
    out = torch.zeros(w.shape, dtype=torch.uint8)
    for (r, c), p in pieces:
        q = quantize_piece(p, (r, c), grid, scales)
        assert q.dtype == FP8_DTYPE and q.shape == p.shape
        out[r:r + p.shape[0], c:c + p.shape[1]] = q.view(torch.uint8)
    return out, scales


def _assert_same(w: torch.Tensor, got_bytes: torch.Tensor, got_scales: torch.Tensor) -> None:
    want, want_scales = _oracle(w)
    assert torch.equal(got_scales, want_scales.float()), "scales differ from vLLM's"
    diff = (got_bytes != want.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} e4m3 bytes differ from vLLM's, first at {diff[0].tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "rows", "cols"), [
    ((512, 384), [171, 342], []),          # 3 FSDP2 row shards of a 512-row weight: 171/171/170
    ((300, 200), [100, 200], [64]),        # uneven rows and a column cut, partial last blocks
    ((256, 384), [], [192]),               # TP column shards that cut a 128-column block
    ((129, 257), [1, 128], [2, 255]),      # one-row and one-column slivers of partial blocks
])
def test_pieces_quantized_apart_equal_vllm_on_the_full_tensor(dtype, shape, rows, cols):
    gen = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[1])).to(dtype)
    got, scales = _quantized_by_pieces(w, rows, cols)
    _assert_same(w, got, scales)
    q, s = quantize_full(w)
    assert torch.equal(q.view(torch.uint8), got) and torch.equal(s, scales)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 400), k=st.integers(1, 300), seed=st.integers(0, 2**16),
       rows=st.lists(st.integers(1, 399), max_size=3), cols=st.lists(st.integers(1, 299), max_size=3),
       scale=st.sampled_from([1e-6, 1e-2, 1.0, 300.0]))
def test_any_cut_of_any_tensor_is_exact(n, k, seed, rows, cols, scale):
    w = torch.randn((n, k), generator=torch.Generator().manual_seed(seed)) * scale
    got, scales = _quantized_by_pieces(w, rows, cols)
    _assert_same(w, got, scales)


def test_an_all_zero_block_gets_the_floor_scale_and_zeros():
    w = torch.zeros(130, 130)
    w[129, 129] = 2.0
    got, scales = _quantized_by_pieces(w, [65], [])
    _assert_same(w, got, scales)
    assert float(scales[0, 0]) == pytest.approx(1e-4 / 448)


def test_a_non_finite_weight_is_refused_naming_the_tensor_and_block():
    w = torch.randn(256, 256)
    w[200, 10] = float("nan")
    grid = BlockGrid("model.layers.3.mlp.down_proj.weight", (256, 256))
    with pytest.raises(QuantizationError, match=r"down_proj.weight: block \(1, 0\) holds a non-finite"):
        piece_amax(w[128:], (128, 0), grid)


def test_a_box_outside_the_tensor_or_short_scales_are_refused():
    grid = BlockGrid("w", (256, 256))
    with pytest.raises(QuantizationError, match="outside"):
        piece_amax(torch.ones(10, 10), (250, 0), grid)
    with pytest.raises(QuantizationError, match="do not reach"):
        quantize_piece(torch.ones(10, 10), (200, 0), grid, torch.ones(1, 2))
    with pytest.raises(QuantizationError, match="2-D"):
        BlockGrid("w", (4, 4, 4))  # type: ignore[arg-type]
