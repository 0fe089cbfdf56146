"""The CUDA kernels' self-checks, and the CUDA block-FP8 kernels checked like the CPU ones:
against fp8's torch expressions on the same GPU, the CPU kernels, and vLLM's quantizer."""

from __future__ import annotations

import pytest
import torch

import awex_fast as af
from awex_fast.transfer import boxcopy, cuda_selfcheck, fp8  # noqa: F401 (they register the checks)
from awex_fast.transfer.fp8 import (
    FP8_DTYPE,
    BlockGrid,
    QuantizationError,
    merge_amax,
    piece_amax,
    quantize_piece,
    quantize_piece_into,
    scales_from_amax,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not af.build_info()["cuda"], reason="awex_fast built without CUDA"),
]

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("kernel", cuda_selfcheck.KERNELS)
def test_every_cuda_kernel_passes_its_self_check(kernel):
    cuda_selfcheck.check(kernel, torch.device("cuda", 0))
    cuda_selfcheck.ensure(kernel, 0)  # cached from here on
    assert (kernel, 0) in cuda_selfcheck._passed


def test_the_cuda_checksum_equals_the_cpu_one_and_torch_formula():
    data = torch.randint(0, 256, ((1 << 20) + 5,), dtype=torch.uint8)
    cpu = af.copy.checksum(data)
    assert af.copy.checksum(data.cuda()) == cpu == cuda_selfcheck.torch_checksum(data.cuda(), data.numel())


def _shards(w: torch.Tensor):
    n, k = w.shape
    rows = [(r, min(171, n - r)) for r in range(0, n, 171)]
    cols = ((0, k // 2), (k // 2, k - k // 2))
    return [((r, c), w[r:r + nr, c:c + nc]) for r, nr in rows for c, nc in cols]


@pytest.mark.parametrize("dtype", FLOATS)
def test_cuda_shards_equal_torch_on_the_gpu_the_cpu_kernels_and_vllm(dtype):
    gen = torch.Generator().manual_seed(11)
    w = ((torch.randn(600, 520, generator=gen) * torch.logspace(-4, 2, 520)).to(dtype))
    w[:128, :128] = 0
    grid = BlockGrid("w", tuple(w.shape))
    wc = w.cuda()
    parts = [piece_amax(p, off, grid) for off, p in _shards(wc)]
    assert all(a.device.type == "cuda" for _, a in parts)
    scales = scales_from_amax(merge_amax(grid, parts))
    cpu_scales = scales_from_amax(merge_amax(grid, [piece_amax(p, off, grid) for off, p in _shards(w)]))
    assert torch.equal(scales, cpu_scales)
    out = torch.full(w.shape, 0x33, dtype=torch.uint8, device="cuda")
    for (r, c), p in _shards(wc):
        region = out[r:r + p.shape[0], c:c + p.shape[1]]
        quantize_piece_into(region, p, (r, c), grid, scales)
        want = fp8._torch_quantize(p, (r, c), grid, scales.cuda()).view(torch.uint8)
        assert torch.equal(region, want), (r, c)
    cpu = quantize_piece(w, (0, 0), grid, cpu_scales).view(torch.uint8)
    assert torch.equal(out.cpu(), cpu)
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm", reason="the oracle is vLLM's quantizer")
    q, s = deep_gemm.per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)
    assert torch.equal(out.cpu(), q.view(torch.uint8)) and torch.equal(cpu_scales, s.float())


def test_cuda_transposed_pieces_and_float8_destinations():
    w = torch.randn(300, 260, device="cuda")
    grid = BlockGrid("w.T", (260, 300), (16, 24))
    piece = w.t()[10:200]
    (_, _), amax = piece_amax(piece, (10, 0), grid)
    full = torch.zeros(grid.grid, device="cuda")
    rows_b, cols_b = grid.blocks_of((10, 0), piece.shape)
    full[rows_b.start:rows_b.stop] = amax
    assert torch.equal(amax, fp8._torch_amax(piece, (10, 0), grid, rows_b, cols_b))
    scales = scales_from_amax(full)
    dst = torch.zeros(piece.shape, dtype=FP8_DTYPE, device="cuda")
    quantize_piece_into(dst, piece, (10, 0), grid, scales)
    want = fp8._torch_quantize(piece, (10, 0), grid, scales).view(torch.uint8)
    assert torch.equal(dst.view(torch.uint8), want)


def test_a_non_finite_cuda_block_is_named():
    w = torch.randn(384, 384, device="cuda")
    w[200, 300] = float("nan")
    w[300, 10] = float("inf")
    with pytest.raises(QuantizationError, match=r"down_proj.weight: block \(1, 2\) holds a non-finite"):
        piece_amax(w[171:], (171, 0), BlockGrid("model.layers.3.mlp.down_proj.weight", (384, 384)))
