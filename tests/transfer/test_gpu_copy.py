"""The CUDA copy kernel checked like the CPU path: against torch slicing, torch.cat and .to()."""

from __future__ import annotations

import pytest
import torch

import awex_fast as af
from awex_fast.transfer import boxcopy as afc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not af.build_info()["cuda"], reason="awex_fast built without CUDA"),
]

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def _views(dtype, gen):
    base = (torch.randn(97, 130, generator=gen) * 10).to(dtype).cuda()
    cube = (torch.randn(5, 6, 7, 8, generator=gen)).to(dtype).cuda()
    return [
        base,
        base[3:50, 7:101],
        base[:, ::3],
        base.t(),
        base[::2, 1::5].t(),
        cube.permute(3, 1, 0, 2)[1:, :, 2:],
        base[:0],
        cube[0, 0, 0, 0],
    ]


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_cuda_pack_unpack_matches_torch(src, dst):
    gen = torch.Generator().manual_seed(0)
    views = _views(src, gen)
    out = torch.empty(sum(v.numel() for v in views), dtype=dst, device="cuda")
    af.copy.pack(views, out)
    expected = torch.cat([v.reshape(-1).to(dst) for v in views])
    assert torch.equal(_bits(out), _bits(expected))
    targets = [
        torch.zeros(v.shape[::-1], dtype=src, device="cuda").permute(*reversed(range(v.dim()))) for v in views
    ]
    af.copy.unpack(out, targets)
    for got, v in zip(targets, views, strict=True):
        assert torch.equal(_bits(got.contiguous()), _bits(v.to(dst).to(src).contiguous()))


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float8_e4m3fn, torch.float64])
def test_cuda_bitwise_and_vectorised_paths(dtype):
    gen = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 120, (4096, 257), generator=gen, dtype=torch.uint8)
    base = (
        raw.view(torch.uint8).cuda() if dtype.itemsize == 1 else raw[:, :256].contiguous().view(dtype).cuda()
    )
    views = [base, base[1:], base[:, 1:], base[::2]]  # aligned and misaligned starts
    out = torch.empty(sum(v.numel() for v in views), dtype=dtype, device="cuda")
    af.copy.pack(views, out)
    assert torch.equal(_bits(out), _bits(torch.cat([v.reshape(-1) for v in views])))


def test_cuda_specials_and_many_boxes():
    vals = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 65520.0, 1e-40, 2.0**-24, 1.00390625])
    for dst in (torch.bfloat16, torch.float16):
        out = torch.empty(vals.numel(), dtype=dst, device="cuda")
        af.copy.pack([vals.cuda()], out)
        assert torch.equal(_bits(out), _bits(vals.cuda().to(dst)))
    base = torch.randn(4096, 64, device="cuda")
    views = list(base.unbind(0))
    out = torch.empty(base.numel(), dtype=torch.bfloat16, device="cuda")
    af.copy.pack(views, out)
    assert torch.equal(out, base.reshape(-1).bfloat16())


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
def test_cuda_casts_of_every_16_bit_pattern_match_torch(src):
    """Every bfloat16 / float16 bit pattern (zeros, subnormals, infinities, NaNs of both signs)
    cast to the other two float dtypes, bit for bit as torch's .to() on the same GPU."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).cuda().view(src)
    for dst in FLOATS:
        if dst == src:
            continue
        out = torch.full((x.numel(),), 0.5, dtype=dst, device="cuda")
        af.copy.pack([x], out)
        got, want, nan = _bits(out), _bits(x.to(dst)), x.isnan()
        assert torch.equal(got[~nan], want[~nan]), (src, dst, "numbers")
        assert torch.equal(got[nan], want[nan]), (src, dst, "NaN bit patterns")


def test_cuda_float32_rounding_ties_and_nans_match_torch():
    """float32 -> bfloat16 / float16 round to nearest even exactly as torch: every sign, exponent
    and top-7 mantissa pattern combined with low bits just below, at and above both dtypes'
    rounding ties (bit 15 for bfloat16, bit 12 for float16), plus random patterns."""
    gen = torch.Generator().manual_seed(3)
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    u = torch.cat(
        [(hi[:, None] | lows[None, :]).reshape(-1), torch.randint(0, 1 << 32, (1 << 20,), generator=gen)]
    )
    u = torch.where(u >= 1 << 31, u - (1 << 32), u)  # two's complement, so .to(int32) is exact
    x = u.to(torch.int32).cuda().view(torch.float32)
    for dst in (torch.bfloat16, torch.float16):
        out = torch.full((x.numel(),), 0.5, dtype=dst, device="cuda")
        af.copy.pack([x], out)
        got, want, nan = _bits(out), _bits(x.to(dst)), x.isnan()
        assert torch.equal(got[~nan], want[~nan]), (dst, "numbers")
        assert torch.equal(got[nan], want[nan]), (dst, "NaN bit patterns")


def test_cuda_box_over_2_pow_32_elements_uses_64_bit_offsets():
    """A strided box of 65537 x 65537 bytes (2^32 + 2^17 + 1 elements, odd rows so no widening)
    takes the kernel's 64-bit unravel path; a 32-bit wrap would misplace the last elements."""
    n = 65537
    free, _ = torch.cuda.mem_get_info()
    if free < 16 << 30:
        pytest.skip("needs 16 GiB of free GPU memory")
    buf = torch.randint(0, 256, (n, n + 1), dtype=torch.uint8, device="cuda")
    view = buf[:, :n]  # row stride n + 1: the two dims cannot coalesce
    out = torch.empty(n * n, dtype=torch.uint8, device="cuda")
    af.copy.pack([view], out)
    out2 = out.view(n, n)
    assert torch.equal(out2[-2:], view[-2:])  # the tail past 2^32 first, cheaply
    assert torch.equal(out2, view)
    del buf, view, out, out2
    torch.cuda.empty_cache()


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_cuda_misaligned_buffer_is_copied_bytewise(wire):
    """A buffer at an odd address (a slice of a byte tensor): the kernel must not issue typed
    (misaligned) accesses, which would be a sticky error for the whole CUDA context."""
    a = torch.randn(1000, device="cuda")
    raw = torch.zeros(4 * 1000 + 1, dtype=torch.uint8, device="cuda")
    buf = raw[1:]  # odd address: every element misaligned
    afc.gather_program([a], buf, [0], wire).run()
    got = buf[: 1000 * wire.itemsize].clone().view(wire)  # the clone is aligned
    assert torch.equal(_bits(got), _bits(a.to(wire)))
    back = torch.zeros_like(a)
    afc.scatter_program(buf, [0], wire, [back]).run()
    assert torch.equal(back, a.to(wire).float())
    torch.cuda.synchronize()


def test_cuda_checksum_equals_cpu_checksum():
    x = torch.randint(0, 255, (1 << 22 | 5,), dtype=torch.uint8)
    assert afc.checksum(x) == afc.checksum(x.cuda())


def test_cuda_program_on_a_side_stream():
    a = torch.randn(512, 512, device="cuda")
    buf = torch.empty(512 * 256 * 2, dtype=torch.uint8, device="cuda")
    prog = afc.gather_program([a[:, ::2]], buf, [0], torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    prog.run(stream=side.cuda_stream)
    side.synchronize()
    assert torch.equal(buf.view(torch.bfloat16), a[:, ::2].reshape(-1).bfloat16())
