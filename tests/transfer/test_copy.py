"""pack/unpack against torch's own slicing, torch.cat and Tensor.to (the independent oracle)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import awex_fast as af
from awex_fast._native import native
from awex_fast.transfer import boxcopy as afc

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
BITWISE = [
    torch.int64,
    torch.uint8,
    torch.int32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bool,
    torch.float64,
]


def _oracle_pack(views, dtype):
    return torch.cat([v.reshape(-1).to(dtype) for v in views]) if views else torch.empty(0, dtype=dtype)


def _bits(t):
    """Bit pattern view, so NaNs and signed zeros compare exactly."""
    if t.dtype.itemsize == 1:
        return t.view(torch.uint8)
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def _random_tensor(shape, dtype, gen):
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:  # float8: any bit pattern but NaN-free ones are easier to read
        return torch.randint(0, 120, shape, generator=gen, dtype=torch.uint8).view(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=gen).to(dtype)


@st.composite
def strided_view(draw, dtype):
    """A random non-contiguous view: a random base tensor, then slice/step/transpose."""
    ndim = draw(st.integers(1, 4))
    base_shape = [draw(st.integers(1, 9)) for _ in range(ndim)]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    base = _random_tensor(base_shape, dtype, gen)
    index = []
    for n in base_shape:
        start = draw(st.integers(0, n - 1))
        stop = draw(st.integers(start, n))  # may be empty
        step = draw(st.integers(1, 3))
        index.append(slice(start, stop, step))
    view = base[tuple(index)]
    if ndim >= 2 and draw(st.booleans()):
        a, b = draw(st.permutations(range(ndim)))[:2]
        view = view.transpose(a, b)
    return view


@settings(max_examples=60, deadline=None)
@given(data=st.data(), src=st.sampled_from(FLOATS), dst=st.sampled_from(FLOATS))
def test_pack_unpack_random_views_all_float_pairs(data, src, dst):
    views = data.draw(st.lists(strided_view(src), min_size=1, max_size=6))
    out = torch.full((sum(v.numel() for v in views),), float("nan"), dtype=dst)
    af.copy.pack(views, out)
    assert torch.equal(_bits(out), _bits(_oracle_pack(views, dst)))

    # unpack into fresh non-contiguous targets (reversed-dim storage), cast back to src
    targets = [torch.zeros(v.shape[::-1], dtype=src).permute(*reversed(range(v.dim()))) for v in views]
    af.copy.unpack(out, targets)
    for got, view in zip(targets, views, strict=True):
        assert torch.equal(_bits(got.contiguous()), _bits(view.to(dst).to(src).contiguous()))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(BITWISE))
def test_bitwise_dtypes_round_trip(data, dtype):
    views = data.draw(st.lists(strided_view(dtype), min_size=1, max_size=5))
    out = torch.empty(sum(v.numel() for v in views), dtype=dtype)
    af.copy.pack(views, out)
    assert torch.equal(_bits(out), _bits(_oracle_pack(views, dtype)))
    back = [torch.empty(v.shape, dtype=dtype) for v in views]
    af.copy.unpack(out, back)
    for got, want in zip(back, views, strict=True):
        assert torch.equal(_bits(got), _bits(want))


def test_special_float_values_match_torch_casts():
    # Ties, subnormals, overflow, infinities, signed zeros and NaN: every rounding corner.
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            float("inf"),
            float("-inf"),
            65504.0,
            65520.0,
            1e6,
            -1e6,
            1e-8,
            -1e-8,
            6e-8,
            5.96e-8,
            1e-40,
            -1e-40,
            3.0e38,
            1.00390625,
            1.01171875,
            1.0009765625,
            1.0029296875,
            2.0**-14,
            2.0**-24,
            2.0**-25,
            1.5 * 2.0**-24,
        ],
        dtype=torch.float32,
    )
    rand = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 4096)
    ties = (
        torch.arange(0, 1 << 16, dtype=torch.int32)
        .bitwise_left_shift(16)
        .bitwise_or(0x8000)
        .view(torch.float32)
    )
    src32 = torch.cat([specials, rand, ties[torch.isfinite(ties)]])
    for src in FLOATS:
        values = src32.to(src)
        for dst in FLOATS:
            out = torch.empty(values.numel(), dtype=dst)
            af.copy.pack([values], out)
            assert torch.equal(_bits(out), _bits(values.to(dst))), (src, dst)


def test_nan_casts_give_a_nan():
    nan = torch.tensor([float("nan")] * 4, dtype=torch.float32)
    for dst in (torch.bfloat16, torch.float16):
        out = torch.empty(4, dtype=dst)
        af.copy.pack([nan], out)
        assert torch.isnan(out).all()
        assert torch.equal(_bits(out), _bits(nan.to(dst)))


def test_many_tiny_boxes_and_empty_ones():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2048, 33, generator=gen)
    views = [base[i, (i % 7) : (i % 7) + (i % 5)] for i in range(2048)]  # sizes 0..4, many empty
    views.append(base[:0])
    out = torch.empty(sum(v.numel() for v in views), dtype=torch.bfloat16)
    af.copy.pack(views, out)
    assert torch.equal(out, _oracle_pack(views, torch.bfloat16))


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_large_boxes_split_across_threads(wire):
    # 4 MiB boxes, column blocks with short contiguous rows (whose source is prefetched row to
    # row), and a transposed one: every thread boundary falls somewhere inside a box, bitwise
    # and casting.
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(1024, 1024, generator=gen)
    views = [a[:, 256 * k : 256 * (k + 1)] for k in range(4)] + [a.t(), a[::3, 1::2]]
    for threads in (1, 2, 3, 7):
        afc.set_num_threads(threads)
        try:
            out = torch.empty(sum(v.numel() for v in views), dtype=wire)
            af.copy.pack(views, out)
            assert torch.equal(out, _oracle_pack(views, wire))
            back = torch.zeros(1024, 1024)
            af.copy.unpack(out[: 4 * 1024 * 256], [back[:, 256 * k : 256 * (k + 1)] for k in range(4)])
            assert torch.equal(back, a.to(wire).float())
        finally:
            afc.set_num_threads(os.cpu_count() or 1)


def _pool_size(cwd: Path, **env: str) -> int:
    """The copy pool's size in a fresh process started with ``env`` (set on top of a clean one).
    ``cwd`` is outside the checkout, so the process imports the package under test, not the
    source tree that ``python -c`` would put first on its path."""
    base = {k: v for k, v in os.environ.items() if k not in ("AWEX_COPY_THREADS", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", "from awex_fast.transfer import boxcopy as afc; "
                          "print(afc.num_threads())"], env={**base, **env}, capture_output=True,
                         text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_the_copy_pool_takes_this_ranks_share_of_the_host(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    pinned = cpus < (os.cpu_count() or 1)
    assert _pool_size(tmp_path) == cpus
    assert _pool_size(tmp_path, LOCAL_WORLD_SIZE="2") == (cpus if pinned else max(1, cpus // 2))
    assert _pool_size(tmp_path, LOCAL_WORLD_SIZE=str(4 * cpus)) == (cpus if pinned else 1)
    assert _pool_size(tmp_path, AWEX_COPY_THREADS="3", LOCAL_WORLD_SIZE="2") == 3
    assert _pool_size(tmp_path, AWEX_COPY_THREADS="lots", LOCAL_WORLD_SIZE="junk") == cpus


def test_unpack_into_fused_views_changes_the_fused_tensor():
    fused = torch.zeros(12, 8)
    q, k, v = fused[:8], fused[8:10], fused[10:]
    src = torch.arange(96, dtype=torch.float32)
    af.copy.unpack(src, [q, k, v])
    assert torch.equal(fused.reshape(-1), src)


def test_pack_at_and_unpack_at_with_explicit_offsets():
    a = torch.randn(6, 5)
    b = torch.randn(3, 4).t()
    buf = torch.zeros(256, dtype=torch.uint8)
    afc.pack_at([a, b], buf, [0, 128], torch.bfloat16)
    assert torch.equal(buf[:60].view(torch.bfloat16), a.reshape(-1).bfloat16())
    assert torch.equal(buf[128 : 128 + 24].view(torch.bfloat16), b.reshape(-1).bfloat16())
    assert torch.count_nonzero(buf[60:128]) == 0  # nothing outside the boxes is written
    a2, b2 = torch.empty(6, 5), torch.empty(4, 3)
    afc.unpack_at(buf, [0, 128], torch.bfloat16, [a2, b2])
    assert torch.equal(a2, a.bfloat16().float()) and torch.equal(b2, b.bfloat16().float())


def test_program_replays_after_source_changes():
    a = torch.randn(40, 40)
    buf = torch.empty(40 * 20 * 4, dtype=torch.uint8)
    prog = afc.gather_program([a[:, ::2]], buf, [0], torch.float32)
    for _ in range(3):
        a.normal_()
        prog.run()
        assert torch.equal(buf.view(torch.float32), a[:, ::2].reshape(-1))


def test_checksum_is_positional_and_deterministic():
    x = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    c = afc.checksum(x)
    assert c == afc.checksum(x.clone())
    y = x.clone()
    y[12345] ^= 1
    assert afc.checksum(y) != c
    swapped = x.clone()
    swapped[:8], swapped[8:16] = x[8:16].clone(), x[:8].clone()
    assert (x[:8] != x[8:16]).any() and afc.checksum(swapped) != c
    assert afc.checksum(x, 1001) == afc.checksum(x[:1001].clone())
    afc.set_num_threads(1)
    try:
        assert afc.checksum(x) == c  # independent of how the work was split
    finally:
        afc.set_num_threads(os.cpu_count() or 1)


# --- errors: raised before any byte moves ------------------------------------------------------


def test_size_mismatch():
    out = torch.zeros(10)
    with pytest.raises(ValueError, match="hold 12 elements but the buffer holds 10"):
        af.copy.pack([torch.ones(3, 4)], out)
    assert torch.count_nonzero(out) == 0


def test_overlapping_destinations_rejected_and_untouched():
    base = torch.zeros(8, 8)
    src = torch.ones(32)
    with pytest.raises(ValueError, match="overlapping destination views: view 0 and view 1"):
        af.copy.unpack(src, [base[:4, :4], base[2:6, 2:6]])
    assert torch.count_nonzero(base) == 0
    with pytest.raises(ValueError, match="overlaps itself"):
        af.copy.unpack(torch.ones(16), [torch.zeros(4).expand(4, 4)])
    # interleaved but disjoint column blocks are fine
    af.copy.unpack(torch.ones(64), [base[:, 0::2], base[:, 1::2]])
    assert torch.equal(base, torch.ones(8, 8))


def test_overlapping_byte_ranges_in_pack_at():
    with pytest.raises(ValueError, match="overlapping byte ranges"):
        afc.pack_at([torch.ones(4), torch.ones(4)], torch.zeros(64, dtype=torch.uint8), [0, 8], torch.float32)


def test_unsupported_dtype_pairs():
    with pytest.raises(ValueError, match=r"unsupported dtype pair torch.int64 -> torch.int32"):
        af.copy.pack([torch.ones(3, dtype=torch.int64)], torch.empty(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"unsupported dtype pair torch\.float32 -> torch\.float8_e4m3fn"):
        af.copy.pack([torch.ones(3)], torch.empty(3, dtype=torch.float8_e4m3fn))


def test_bounds_alignment_and_device_checks():
    buf = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit in the 16-byte buffer"):
        afc.pack_at([torch.ones(4)], buf, [4], torch.float32)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        afc.pack_at([torch.ones(2)], buf, [2], torch.float32)
    with pytest.raises(ValueError, match="copies CPU and CUDA tensors only"):
        af.copy.pack([torch.ones(2, device="meta")], torch.empty(2))
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        af.copy.pack([[1.0, 2.0]], torch.empty(2))


@pytest.mark.skipif(
    af.build_info()["cuda"] or not torch.cuda.is_available(),
    reason="needs a CUDA device and a CPU-only build of awex_fast",
)
def test_cuda_tensor_without_cuda_build():
    with pytest.raises(ValueError, match="built without CUDA"):
        af.copy.pack([torch.ones(2, device="cuda")], torch.empty(2, device="cuda"))


def test_build_info_reflects_the_build():
    info = af.build_info()
    assert set(info) >= {"version", "cuda", "cuda_version", "cuda_archs", "compiler", "threads"}
    assert info["version"] == af.__version__
    assert info["threads"] >= 1
    expected = os.environ.get("AWEX_FAST_EXPECT_CUDA")  # set by .ci/run for each build it makes
    if expected is not None:
        assert info["cuda"] is (expected == "1")
    if info["cuda"]:
        assert info["cuda_version"] and info["cuda_archs"]
    else:
        assert info["cuda_version"] == "" and info["cuda_archs"] == ""


def test_direct_program_casts_across_strides():
    a = torch.randn(30, 20)
    dst = torch.zeros(20, 30, dtype=torch.bfloat16).t()
    afc.direct_program([a, a[::2, 3:7]], [dst, torch.zeros(15, 4)]).run()
    assert torch.equal(dst, a.bfloat16())
    target = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="overlapping destinations"):
        afc.direct_program([torch.ones(2, 2), torch.ones(2, 2)], [target[:2, :2], target[1:3, 1:3]])
    assert torch.count_nonzero(target) == 0
    with pytest.raises(ValueError, match="source shape"):
        afc.direct_program([torch.ones(2, 3)], [torch.ones(3, 2)])


def test_per_view_wire_dtypes():
    a, b = torch.randn(5, 3), torch.randn(7)
    buf = torch.zeros(128, dtype=torch.uint8)
    afc.pack_at([a, b], buf, [0, 64], [torch.float32, torch.float16])
    assert torch.equal(buf[:60].view(torch.float32), a.reshape(-1))
    assert torch.equal(buf[64:78].view(torch.float16), b.half())


def test_random_bit_patterns_cast_like_torch_on_every_vector_tail():
    # Every float32 bit pattern class (NaN payloads, subnormals, both signs) at lengths that end
    # mid-vector, so the cloned AVX-512 / AVX2 loops and their scalar tails are all checked.
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)
    for n in (1, 15, 17, 31, 33, 63, 64, 65, 129, 1000, 1 << 20):
        for dst in (torch.bfloat16, torch.float16):
            out = torch.empty(n, dtype=dst)
            af.copy.pack([values[:n]], out)
            assert torch.equal(_bits(out), _bits(values[:n].to(dst))), (n, dst)
        back = torch.empty(n, dtype=torch.float32)
        half = values[:n].to(torch.bfloat16)
        af.copy.unpack(half, [back])
        assert torch.equal(_bits(back), _bits(half.to(torch.float32))), n


@pytest.mark.parametrize("threads", [1, 3])
def test_long_runs_copy_exactly_at_every_alignment(threads):
    # Runs from 16 KiB up take the prefetching copy (packs, direct copies with streaming=False)
    # or the non-temporal one (unpacks, direct copies, copy_bytes with streaming=True), whose
    # aligned body, unaligned head and tail are each exercised here; the bytes next to every
    # destination range must stay untouched.
    gen = torch.Generator().manual_seed(11)
    src = torch.randint(0, 256, (1 << 20,), generator=gen, dtype=torch.uint8)
    afc.set_num_threads(threads)
    try:
        for n in (16 * 1024 - 1, 16 * 1024, 16 * 1024 + 255, 300_001):
            for s_off, d_off in ((0, 0), (1, 7), (63, 64), (5, 33)):
                for streaming in (False, True):
                    dst = torch.full((n + 200,), 0xAB, dtype=torch.uint8)
                    native().copy.copy_bytes(
                        dst.data_ptr() + d_off, src.data_ptr() + s_off, n, streaming
                    )
                    assert torch.equal(dst[d_off : d_off + n], src[s_off : s_off + n]), (n, s_off, d_off)
                    assert bool((dst[:d_off] == 0xAB).all()) and bool((dst[d_off + n :] == 0xAB).all())
                    out = torch.full((n + 200,), 0xCD, dtype=torch.uint8)
                    afc.direct_program([src[s_off : s_off + n]], [out[d_off : d_off + n]], streaming).run()
                    assert torch.equal(out[d_off : d_off + n], src[s_off : s_off + n])
                    assert bool((out[d_off + n :] == 0xCD).all())
            back = torch.zeros(n + 3, dtype=torch.uint8)
            af.copy.unpack_at(src, [1], torch.uint8, [back[3:]])  # a streaming unpack
            assert torch.equal(back[3:], src[1 : n + 1]) and bool((back[:3] == 0).all())
    finally:
        afc.set_num_threads(os.cpu_count() or 1)


def test_copy_bytes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="negative byte count"):
        native().copy.copy_bytes(1, 1, -1, False)
    with pytest.raises(ValueError, match="null pointer"):
        native().copy.copy_bytes(0, 8, 16, False)


def _mix64(x):
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def test_checksum_matches_its_definition_computed_independently():
    # sum over 8-byte little-endian words w_i of mix64(w_i ^ mix64(i + golden)), plus the tail
    # word and mix64(nbytes), mod 2**64: recomputed with numpy, so the vectorised native loop
    # (AVX-512 / AVX2 clones) is checked against the definition, not against itself.
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (100_003,), generator=gen, dtype=torch.uint8)
    raw = data.numpy().tobytes()
    n = len(raw) // 8
    with np.errstate(over="ignore"):
        words = np.frombuffer(raw[: n * 8], dtype="<u8").copy()
        idx = np.arange(n + 1, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        tail = np.frombuffer(raw[n * 8 :] + bytes(8 - (len(raw) - n * 8)), dtype="<u8").copy()
        terms = _mix64(np.concatenate([words, tail]) ^ _mix64(idx))
        want = int(terms.sum(dtype=np.uint64)) + int(_mix64(np.array([len(raw)], dtype=np.uint64))[0])
    assert afc.checksum(data) == want % (1 << 64)
