"""The CUDA copy kernel checked like the CPU path: against torch slicing, torch.cat and .to()."""

from __future__ import annotations

import pytest
import torch

import awex_fast as af
from awex_fast import copy as afc

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
