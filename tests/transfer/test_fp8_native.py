"""The native block-FP8 kernels (csrc/quant, CPU) behind awex_fast.transfer.fp8: bit for bit
torch's ``.to(torch.float8_e4m3fn)`` for every class of float32 input, fp8's own torch
expressions (kept as the fallback) for any strided piece at any offset, vLLM's
``per_block_cast_to_fp8`` for whole tensors quantized piece by piece, and the same errors.
The CPU self-check (cuda_selfcheck.check on the CPU kernels) is exercised here too.

An exhaustive run over all 2^32 float32 bit patterns (same comparison as
test_e4m3_rounding_matches_torch_on_float32_classes, 64 chunks of 2^26) gave 0 differences on
torch 2.13; it takes a minute, so the test keeps a large sample."""

from __future__ import annotations

import ctypes

import pytest
import torch

from awex_fast.transfer import boxcopy, cuda_selfcheck, fp8  # noqa: F401 (they register the checks)
from awex_fast.transfer.fp8 import (
    FP8_DTYPE,
    BlockGrid,
    QuantizationError,
    merge_amax,
    piece_amax,
    quantize_full,
    quantize_piece,
    quantize_piece_into,
    scales_from_amax,
)

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _native_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The native kernel's e4m3 bytes of float32 ``x`` (1-D) with every scale 1 (x * 1.0 == x)."""
    x = x.reshape(-1, 64)
    grid = BlockGrid("x", tuple(x.shape), (16, 64))
    assert fp8._native_for(x) is not None, "the native kernels are not built: this would test torch"
    return quantize_piece(x, (0, 0), grid, torch.ones(grid.grid)).view(torch.uint8).reshape(-1)


def _assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, inputs: torch.Tensor) -> None:
    diff = (got != want).nonzero()
    if diff.numel():
        i = int(diff[0, 0])
        bits = int(inputs.reshape(-1).view(torch.int32)[i]) & 0xffffffff
        pytest.fail(f"{diff.shape[0]} bytes differ; first: input bits {bits:#010x} -> {int(got[i]):#04x}, "
                    f"torch gives {int(want[i]):#04x}")


def test_e4m3_rounding_matches_torch_on_all_bf16_values():
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    _assert_bytes_equal(_native_e4m3(x), x.to(FP8_DTYPE).view(torch.uint8), x)


def _float32_classes() -> torch.Tensor:
    """Random bit patterns, plus every e4m3 value, every midpoint between neighbours (the ties),
    and the float32 values 1 and 2 ulps around each, of both signs; specials; float32 subnormals;
    NaNs with several payloads."""
    gen = torch.Generator().manual_seed(7)
    random = torch.randint(-(1 << 31), 1 << 31, (1 << 22,), generator=gen, dtype=torch.int64).to(torch.int32)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    codes = codes[torch.isfinite(codes)].unique()
    mids = (codes[:-1].double() + codes[1:].double()) / 2  # exact in float32: e4m3 has 3 mantissa bits
    marks = torch.cat([codes, mids.float(), torch.tensor([448.0, 456.0, 464.0, 480.0, 2.0 ** -6, 2.0 ** -9,
                                                          2.0 ** -10, 3 * 2.0 ** -11, 1e38])])
    around = marks.view(torch.int32)[:, None] + torch.arange(-2, 3, dtype=torch.int32)
    specials = torch.tensor([0x7f800000, 0x7f800001, 0x7fc00000, 0x7fffffff, 0x00000001, 0x007fffff,
                             0x00400000, 0x3a800000, 0x3affffff, 0x7f7fffff], dtype=torch.int32)
    sub = torch.randint(0, 1 << 23, (1 << 14,), generator=gen, dtype=torch.int32)
    patterns = torch.cat([random, around.reshape(-1), specials, sub])
    patterns = torch.cat([patterns, patterns | torch.tensor(-(1 << 31), dtype=torch.int32)])  # negatives
    pad = (-patterns.numel()) % 1024
    return torch.cat([patterns, patterns[:pad]]).view(torch.float32)


def test_e4m3_rounding_matches_torch_on_float32_classes():
    x = _float32_classes()
    _assert_bytes_equal(_native_e4m3(x), x.to(FP8_DTYPE).view(torch.uint8), x)


def test_e4m3_saturation_and_nan_as_torch_does():
    # what torch 2.13's CPU cast gives, and so the kernel: finite overflow and inf saturate to
    # +-448, NaN keeps its sign, -0.0 stays negative zero
    x = torch.tensor([448.0, 456.0, 456.00003, 464.0, 1e30, float("inf"), -float("inf"), float("nan"),
                      -float("nan"), -0.0, 2.0 ** -10, 2.0 ** -10 + 2.0 ** -30] * 6)
    want = [0x7e, 0x7e, 0x7e, 0x7e, 0x7e, 0x7e, 0xfe, 0x7f, 0xff, 0x80, 0x00, 0x01] * 6
    got = _native_e4m3(torch.cat([x, torch.zeros(64 - x.numel() % 64)]))[:x.numel()]
    assert got.tolist() == want
    assert x.to(FP8_DTYPE).view(torch.uint8).tolist() == want


def _weight(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * torch.logspace(-4, 2, shape[1])
    return w.to(dtype)


def _pieces(w: torch.Tensor) -> list[tuple[str, torch.Tensor, tuple[int, int], BlockGrid]]:
    """Pieces the trainer hands the kernels: shards that cut blocks (171-row FSDP shards, TP
    column halves), partial last blocks, stepped and transposed views."""
    n, k = w.shape
    g, gt = BlockGrid("w", (n, k)), BlockGrid("w.T", (k, n))
    return [
        ("whole", w, (0, 0), g),
        ("rows 0:171", w[:171], (0, 0), g),
        ("rows 171:342", w[171:342], (171, 0), g),
        ("rows 342:", w[342:], (342, 0), g),
        ("column half", w[:, k // 2:], (0, k // 2), g),
        ("one block's corner", w[130:131, 250:251], (130, 250), g),
        ("transposed", w.t(), (0, 0), gt),
        ("transposed rows 100:300", w.t()[100:300], (100, 0), gt),
        ("stepped", w[::2, ::3], (0, 0), BlockGrid("w.s", (len(range(0, n, 2)), len(range(0, k, 3))))),
    ]


@pytest.mark.parametrize("dtype", FLOATS)
def test_piece_amax_equals_the_torch_expression(dtype):
    w = _weight((512, 300), dtype, 1)
    w[:128, :128] = 0  # an all-zero block
    for case, piece, offset, grid in _pieces(w):
        assert fp8._native_for(piece) is not None
        rows_b, cols_b = grid.blocks_of(offset, piece.shape)
        (i, j), got = piece_amax(piece, offset, grid)
        assert (i, j) == (rows_b.start, cols_b.start), case
        want = fp8._torch_amax(piece, offset, grid, rows_b, cols_b)
        assert got.dtype == torch.float32 and torch.equal(got, want), case


@pytest.mark.parametrize("dtype", FLOATS)
def test_quantize_piece_equals_the_torch_expression_and_into_strided_destinations(dtype):
    w = _weight((512, 300), dtype, 2)
    for case, piece, offset, grid in _pieces(w):
        scales = scales_from_amax(merge_amax(grid, [piece_amax(piece, offset, grid)]))
        want = fp8._torch_quantize(piece, offset, grid, scales).view(torch.uint8)
        got = quantize_piece(piece, offset, grid, scales)
        assert got.dtype == FP8_DTYPE and torch.equal(got.view(torch.uint8), want), case
        # fused: into a transposed uint8 buffer's region, and into a float8 tensor's
        big = torch.full((piece.shape[1] + 3, piece.shape[0] + 5), 0x33, dtype=torch.uint8)
        region = big.t()[2:2 + piece.shape[0], 1:1 + piece.shape[1]]
        quantize_piece_into(region, piece, offset, grid, scales)
        assert torch.equal(region, want), case
        untouched = big.clone()
        untouched.t()[2:2 + piece.shape[0], 1:1 + piece.shape[1]] = 0x33
        assert bool((untouched == 0x33).all()), f"{case}: bytes outside the region were written"
        f8 = torch.zeros(piece.shape, dtype=FP8_DTYPE)
        quantize_piece_into(f8, piece, offset, grid, scales)
        assert torch.equal(f8.view(torch.uint8), want), case


def test_every_scale_is_inverted_as_torch_does():
    # 1x1 blocks with arbitrary float32 scales: each element has its own reciprocal
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen)
    scales = torch.exp(torch.empty(64, 256).uniform_(-20, 20, generator=gen))
    grid = BlockGrid("w", (64, 256), (1, 1))
    got = quantize_piece(x, (0, 0), grid, scales).view(torch.uint8)
    assert torch.equal(got, fp8._torch_quantize(x, (0, 0), grid, scales).view(torch.uint8))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(512, 384), (300, 200), (129, 257), (1, 5)])
def test_shards_quantized_apart_equal_vllm_on_the_full_tensor(dtype, shape):
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm", reason="the oracle is vLLM's quantizer")
    w = _weight(shape, dtype, sum(shape))
    n, k = shape
    grid = BlockGrid("w", shape)
    rows = [(r, min(171, n - r)) for r in range(0, n, 171)]
    cols = [(0, k)] if k < 2 else [(0, k // 2), (k // 2, k - k // 2)]
    pieces = [((r, c), w[r:r + nr, c:c + nc]) for r, nr in rows for c, nc in cols]
    scales = scales_from_amax(merge_amax(grid, [piece_amax(p, off, grid) for off, p in pieces]))
    out = torch.full(shape, 0x33, dtype=torch.uint8)
    for (r, c), p in pieces:
        quantize_piece_into(out[r:r + p.shape[0], c:c + p.shape[1]], p, (r, c), grid, scales)
    want, want_scales = deep_gemm.per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)
    assert torch.equal(scales, want_scales.float())
    assert torch.equal(out, want.view(torch.uint8))
    q, s = quantize_full(w)
    assert torch.equal(q.view(torch.uint8), out) and torch.equal(s, scales)


def test_an_all_zero_block_gets_the_floor_scale():
    w = torch.zeros(256, 130, dtype=torch.bfloat16)
    w[200, 129] = -3.0
    grid = BlockGrid("w", (256, 130))
    (_, _), amax = piece_amax(w, (0, 0), grid)
    assert amax.tolist() == [[0.0, 0.0], [0.0, 3.0]]
    scales = scales_from_amax(amax)
    assert float(scales[0, 0]) == pytest.approx(1e-4 / 448)
    q = quantize_piece(w, (0, 0), grid, scales).view(torch.uint8)
    assert int(q[200, 129]) == 0xfe and int(q.count_nonzero()) == 1


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_first_non_finite_block_is_named(dtype):
    w = torch.randn(384, 384).to(dtype)
    w[300, 10] = float("inf")   # block (2, 0)
    w[200, 300] = float("nan")  # block (1, 2): first in row-major order
    w[260, 200] = float("nan")  # block (2, 1)
    name = "model.layers.3.mlp.down_proj.weight"
    grid = BlockGrid(name, (384, 384))
    with pytest.raises(QuantizationError, match=r"down_proj.weight: block \(1, 2\) holds a non-finite"):
        piece_amax(w[171:], (171, 0), grid)
    with pytest.raises(QuantizationError, match=r"block \(2, 0\) holds a non-finite"):
        piece_amax(w[256:, :128], (256, 0), grid)
    # a transposed piece: the blocks of its own (transposed) grid, in its row-major order
    with pytest.raises(QuantizationError, match=r"w.T: block \(0, 2\) holds a non-finite"):
        piece_amax(w.t(), (0, 0), BlockGrid("w.T", (384, 384)))


def test_destinations_that_do_not_fit_are_refused():
    grid = BlockGrid("w", (256, 256))
    piece, scales = torch.ones(10, 10), torch.ones(2, 2)
    with pytest.raises(QuantizationError, match="must be uint8"):
        quantize_piece_into(torch.zeros(10, 10), piece, (0, 0), grid, scales)
    with pytest.raises(QuantizationError, match="does not match"):
        quantize_piece_into(torch.zeros(10, 9, dtype=torch.uint8), piece, (0, 0), grid, scales)
    with pytest.raises(QuantizationError, match="stride-0"):
        quantize_piece_into(torch.zeros(1, 10, dtype=torch.uint8).expand(10, 10), piece, (0, 0), grid, scales)
    with pytest.raises(QuantizationError, match="do not reach"):
        quantize_piece_into(torch.zeros(10, 10, dtype=torch.uint8), piece, (200, 0), grid, torch.ones(1, 2))


def test_float64_takes_the_torch_path_with_the_same_result():
    w = _weight((200, 150), torch.float32, 5)
    grid = BlockGrid("w", (200, 150))
    assert fp8._native_for(w.double()) is None
    (_, _), a64 = piece_amax(w.double(), (0, 0), grid)
    (_, _), a32 = piece_amax(w, (0, 0), grid)
    assert torch.equal(a64, a32)
    s = scales_from_amax(a32)
    assert torch.equal(quantize_piece(w.double(), (0, 0), grid, s).view(torch.uint8),
                       quantize_piece(w, (0, 0), grid, s).view(torch.uint8))


def test_tensor_subclasses_take_the_torch_path():
    class Wrapped(torch.Tensor):
        pass

    w = _weight((200, 150), torch.bfloat16, 6)
    sub = w.as_subclass(Wrapped)
    grid = BlockGrid("w", (200, 150))
    assert fp8._native_for(sub) is None and fp8._native_for(torch.nn.Parameter(w)) is not None
    (_, _), amax = piece_amax(sub, (0, 0), grid)
    assert torch.equal(torch.Tensor(amax), piece_amax(w, (0, 0), grid)[1])
    s = scales_from_amax(piece_amax(w, (0, 0), grid)[1])
    got = torch.Tensor(quantize_piece(sub, (0, 0), grid, s)).view(torch.uint8)
    assert torch.equal(got, quantize_piece(w, (0, 0), grid, s).view(torch.uint8))


# --- the self-check's comparison, run on the CPU kernels ---------------------------------------

@pytest.mark.parametrize("kernel", cuda_selfcheck.KERNELS)
def test_the_self_check_passes_on_the_cpu_kernels(kernel):
    cuda_selfcheck.check(kernel, torch.device("cpu"))


def test_the_self_check_names_kernel_device_and_element_of_a_wrong_result(monkeypatch):
    from awex_fast._native import native
    quant = native().quant
    real = quant.quantize_blocks

    def off_by_one(*args, **kwargs):  # the real kernel, then byte (0, 0) of its output flipped
        real(*args, **kwargs)
        dst = args[13]
        ctypes.c_uint8.from_address(dst).value ^= 1

    monkeypatch.setattr(quant, "quantize_blocks", off_by_one)
    with pytest.raises(cuda_selfcheck.KernelSelfCheckError,
                       match=r"native quantize_blocks kernel failed its self-check on cpu \(torch.float32 "
                             r"whole, block \(128, 128\)\): first differing element \[0, 0\]"):
        cuda_selfcheck.check("quantize_blocks", torch.device("cpu"))


def test_the_self_check_catches_a_kernel_that_writes_nothing(monkeypatch):
    from awex_fast._native import native
    monkeypatch.setattr(native().copy, "copy_boxes", lambda *a, **k: None)
    with pytest.raises(cuda_selfcheck.KernelSelfCheckError, match="native copy kernel failed"):
        cuda_selfcheck.check("copy", torch.device("cpu"))
    monkeypatch.setattr(native().quant, "block_amax", lambda *a, **k: -1)
    with pytest.raises(cuda_selfcheck.KernelSelfCheckError, match="native block_amax kernel failed"):
        cuda_selfcheck.check("block_amax", torch.device("cpu"))
    real = native().copy.checksum
    monkeypatch.setattr(native().copy, "checksum", lambda *a: real(*a) ^ 1)
    with pytest.raises(cuda_selfcheck.KernelSelfCheckError, match=r"checksum kernel .* \(0 bytes\)"):
        cuda_selfcheck.check("checksum", torch.device("cpu"))


def test_a_failed_check_keeps_failing_and_a_pass_is_cached(monkeypatch):
    calls = []

    def fake_check(kernel, device):
        calls.append((kernel, device.index))
        if kernel == "cast":
            raise cuda_selfcheck.KernelSelfCheckError("cast is wrong here")

    monkeypatch.setattr(cuda_selfcheck, "check", fake_check)
    monkeypatch.setattr(cuda_selfcheck, "_passed", set())
    monkeypatch.setattr(cuda_selfcheck, "_failed", {})
    for _ in range(3):
        cuda_selfcheck.ensure("copy", 3)
        with pytest.raises(cuda_selfcheck.KernelSelfCheckError, match="cast is wrong here"):
            cuda_selfcheck.ensure("cast", 3)
    assert calls == [("copy", 3), ("cast", 3)]
