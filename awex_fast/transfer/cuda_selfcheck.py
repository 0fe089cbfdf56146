"""Every CUDA kernel of the native core checks itself against torch on each device before it
serves a result.

The CUDA kernels (the batched copy, the dtype casts, the checksum, the block-FP8 amax and
quantizer) are compiled for architectures, toolkits and drivers that CI never runs, and a
wrong byte in a weight update is silent. So the first time a process takes a kernel's CUDA path
on a device, `ensure` runs that kernel on a small random strided sample (special values
included) and compares it with torch's own ops on the same device: on a mismatch it raises
`KernelSelfCheckError` naming the kernel, the device and the first differing element, and it
keeps raising for that (kernel, device), so no result of that kernel is ever used there. A pass
is cached per (kernel, device) for the life of the process.

`check` is the comparison itself, for any device: the tests run it against the CPU kernels, so
the logic is exercised where there is no GPU.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["KERNELS", "KernelSelfCheckError", "check", "ensure"]

KERNELS: tuple[str, ...] = ("copy", "cast", "checksum", "block_amax", "quantize_blocks")

_MASK64 = (1 << 64) - 1
_lock = threading.Lock()
_passed: set[tuple[str, int]] = set()
_failed: dict[tuple[str, int], str] = {}


class KernelSelfCheckError(RuntimeError):
    """A native kernel gave a result that differs from torch's on a device; it is not used there."""


def ensure(kernel: str, device: int) -> None:
    """Make sure ``kernel`` (one of `KERNELS`) passed its self-check on CUDA device ``device`` in
    this process, running it on first use (a few small kernel launches and a sync); raises
    `KernelSelfCheckError` when it failed, now or on an earlier call."""
    key = (kernel, device)
    if key in _passed:
        return
    with _lock:  # one check per key even when several threads start together
        if key in _passed:
            return
        if key not in _failed:
            try:
                check(kernel, torch.device("cuda", device))
            except KernelSelfCheckError as exc:
                _failed[key] = str(exc)
            else:
                _passed.add(key)
                return
        raise KernelSelfCheckError(_failed[key])


def check(kernel: str, device: torch.device) -> None:
    """Run ``kernel``'s native implementation on ``device`` (CPU or CUDA) on its sample and
    compare it with torch's ops there; raises `KernelSelfCheckError` on the first difference."""
    checks = {"copy": _check_copy, "cast": _check_cast, "checksum": _check_checksum,
              "block_amax": _check_block_amax, "quantize_blocks": _check_quantize}
    if kernel not in checks:
        raise ValueError(f"no self-check for kernel {kernel!r} (known: {', '.join(KERNELS)})")
    checks[kernel](torch.device(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- comparison ------------------------------------------------------------------------------

def _fail(kernel: str, device: torch.device, case: str, detail: str) -> None:
    raise KernelSelfCheckError(
        f"awex_fast's native {kernel} kernel failed its self-check on {device} ({case}): {detail}; it is "
        "not used on this device (is the extension built for this GPU's architecture and this driver? "
        "rebuild it, or report this with `awex_fast.build_info()` and torch's version)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _compare(kernel: str, device: torch.device, case: str, got: torch.Tensor, want: torch.Tensor,
             nan_bits_free: bool = False) -> None:
    """Bitwise equality of ``got`` and ``want`` (same shape); with ``nan_bits_free`` a NaN must
    meet a NaN but its bit pattern is free (see _check_cast)."""
    if tuple(got.shape) != tuple(want.shape):
        _fail(kernel, device, case, f"shape {tuple(got.shape)}, torch's is {tuple(want.shape)}")
    same = _bits(got) == _bits(want)
    if nan_bits_free and got.is_floating_point():
        same |= torch.isnan(got.contiguous()) & torch.isnan(want.contiguous())
    if bool(same.all()):
        return
    index = tuple(int(i) for i in (~same).nonzero()[0])
    g, w = got.contiguous()[index], want.contiguous()[index]
    _fail(kernel, device, case, f"first differing element {list(index)}: got {g.item()!r} "
          f"(bits {int(_bits(g.reshape(1))[0]) & _MASK64:#x}), torch gives {w.item()!r} "
          f"(bits {int(_bits(w.reshape(1))[0]) & _MASK64:#x})")


# --- samples ---------------------------------------------------------------------------------

def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(20240607)  # the same sample on every device and run


def _floats(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """float32 values (made on the CPU: the same on every device) over many magnitudes, with the
    special classes the casts must handle sprinkled in."""
    x = torch.randn(shape, generator=gen) * torch.logspace(-12, 6, shape[1]).to(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-40, 2.0 ** -126,
                            65504.0, 65520.0, -65536.0, 3.4e38, 448.0, 464.0, -480.0, 2.0 ** -10,
                            1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 2.0 ** -24, 2.0 ** -25])
    where = torch.randint(0, x.numel(), (4 * special.numel(),), generator=gen)
    x.view(-1)[where] = special.repeat(4)
    return x


def _views(base: torch.Tensor) -> list[torch.Tensor]:
    """Strided views of a 2-D tensor the kernels must walk: whole, cut, stepped, transposed."""
    return [base, base[3:50, 7:101], base[:, ::3], base.t(), base[::2, 1::5].t(), base[5:6, 2:3]]


# --- the kernels' checks ---------------------------------------------------------------------

def _raw_copy(program: object, device: torch.device) -> None:
    """Run a CopyProgram's descriptors straight through the kernel (no self-check: this is it)."""
    from awex_fast._native import native
    index = -1 if device.type == "cpu" else device.index
    stream = 0 if index < 0 else int(torch.cuda.current_stream(index).cuda_stream)
    native().copy.copy_boxes(program.desc, index, stream, program.streaming)  # type: ignore[attr-defined]


def _pack_unpack(kernel: str, device: torch.device, views: list[torch.Tensor], wire: torch.dtype,
                 case: str, nan_bits_free: bool) -> None:
    from awex_fast.transfer import boxcopy
    sizes = [v.numel() for v in views]
    buf = torch.full((sum(sizes) * wire.itemsize,), 0x5A, dtype=torch.uint8, device=device)
    offsets = [sum(sizes[:i]) * wire.itemsize for i in range(len(views))]
    _raw_copy(boxcopy.gather_program(views, buf, offsets, wire), device)
    want = torch.cat([v.reshape(-1).to(wire) for v in views])
    _compare(kernel, device, f"{case}: pack to {wire}", buf.view(wire), want, nan_bits_free)
    # back into transposed (strided) destinations of the views' own dtype
    targets = [torch.zeros(v.shape[::-1], dtype=v.dtype, device=device).t() for v in views]
    _raw_copy(boxcopy.scatter_program(buf, offsets, wire, targets), device)
    for k, (got, v) in enumerate(zip(targets, views, strict=True)):
        _compare(kernel, device, f"{case}: unpack view {k} from {wire}", got, v.to(wire).to(v.dtype),
                 nan_bits_free)


def _check_copy(device: torch.device) -> None:
    """Bitwise copies (same dtype on both sides) of strided views of several element sizes."""
    gen = _generator()
    raw = torch.randint(0, 256, (97, 130), generator=gen, dtype=torch.uint8)
    for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.int64):
        base = raw if dtype == torch.uint8 else torch.randint(
            0, 256, (97, 130 * dtype.itemsize), generator=gen, dtype=torch.uint8).view(dtype)
        _pack_unpack("copy", device, _views(base.to(device)), dtype, f"{dtype} views", nan_bits_free=False)


def _check_cast(device: torch.device) -> None:
    """Every cast among float32 / bfloat16 / float16, against ``Tensor.to``. A NaN must stay a NaN
    but its payload is not compared: torch's own CPU kernels give different NaN bits in their
    vectorised and scalar loops, and no value depends on them."""
    gen = _generator()
    values = _floats((61, 130), gen)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    for src in floats:
        base = values.to(src).to(device)
        for wire in floats:
            if wire != src:
                _pack_unpack("cast", device, _views(base), wire, f"{src} views", nan_bits_free=True)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (csrc/copy/checksum.h) on int64 tensors: wrapping multiplies, and
    logical right shifts as arithmetic shifts with the sign bits masked off."""
    def srl(v: torch.Tensor, k: int) -> torch.Tensor:
        return (v >> k) & ((1 << (64 - k)) - 1)

    def signed(c: int) -> int:
        return c - (1 << 64) if c >= 1 << 63 else c

    x = x ^ srl(x, 30)
    x = x * signed(0xbf58476d1ce4e5b9)
    x = x ^ srl(x, 27)
    x = x * signed(0x94d049bb133111eb)
    return x ^ srl(x, 31)


def torch_checksum(buf: torch.Tensor, nbytes: int) -> int:
    """The native checksum (csrc/copy/checksum.h) of the first ``nbytes`` bytes of a contiguous
    uint8 tensor, computed with torch ops on its device (the self-check's oracle)."""
    words = nbytes // 8
    index = torch.arange(words + 1, dtype=torch.int64, device=buf.device)
    tail = torch.zeros(8, dtype=torch.uint8, device=buf.device)
    tail[:nbytes - words * 8] = buf[words * 8:nbytes]
    w = torch.cat([buf[:words * 8].view(torch.int64), tail.view(torch.int64)])
    golden = 0x9e3779b97f4a7c15 - (1 << 64)
    terms = _mix64(w ^ _mix64(index + golden))
    size = _mix64(torch.tensor([nbytes], dtype=torch.int64, device=buf.device))
    return (int(terms.sum()) + int(size[0])) & _MASK64


def _check_checksum(device: torch.device) -> None:
    """The positional checksum of byte ranges of several lengths (a partial last word included)."""
    from awex_fast._native import native
    gen = _generator()
    data = torch.randint(0, 256, (3 * 65536 + 13,), generator=gen, dtype=torch.uint8).to(device)
    index = -1 if device.type == "cpu" else device.index
    for n in (0, 7, 8, 4099, data.numel()):
        stream = 0 if index < 0 else int(torch.cuda.current_stream(index).cuda_stream)
        got = int(native().copy.checksum(data.data_ptr(), n, index, stream))
        want = torch_checksum(data, n)
        if got != want:
            _fail("checksum", device, f"{n} bytes", f"got {got:#018x}, torch gives {want:#018x}")


def _quant_cases(device: torch.device) -> list[tuple[str, torch.Tensor, tuple[int, int], object]]:
    """(case, piece, offset, grid): pieces that cut blocks, partial last blocks, strided and
    transposed pieces, of each float dtype, with a few all-zero blocks."""
    from awex_fast.transfer.fp8 import BlockGrid
    gen = _generator()
    w = _floats((300, 260), gen)
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
    """Per-block amax against fp8's torch expression, and a non-finite block seen as one."""
    from awex_fast.transfer import fp8
    quant = fp8._native_quant(device.type)
    if quant is None:
        _fail("block_amax", device, "loading", "the native core has no quant kernels for this device")
    cases = _quant_cases(device)
    poisoned = cases[0][1].clone()
    poisoned[130, 200] = float("nan")
    poisoned[5, 140] = float("inf")
    cases.append(("float32 with a NaN and an inf", poisoned, (0, 0), cases[0][3]))
    for case, piece, offset, grid in cases:
        rows_b, cols_b = grid.blocks_of(offset, piece.shape)  # type: ignore[attr-defined]
        want = fp8._torch_amax(piece, offset, grid, rows_b, cols_b)  # type: ignore[arg-type]
        got = torch.full((len(rows_b), len(cols_b)), -1.0, dtype=torch.float32, device=device)
        fp8._native_amax(quant, piece, offset, grid, got)  # type: ignore[arg-type]
        finite = torch.isfinite(want)
        _compare("block_amax", device, case + " (non-finite blocks)", torch.isfinite(got), finite)
        _compare("block_amax", device, case, torch.where(finite, got, 0.0), torch.where(finite, want, 0.0))


def _check_quantize(device: torch.device) -> None:
    """e4m3 bytes against fp8's torch expression, written into transposed destinations."""
    from awex_fast.transfer import fp8
    quant = fp8._native_quant(device.type)
    if quant is None:
        _fail("quantize_blocks", device, "loading", "the native core has no quant kernels for this device")
    for case, piece, offset, grid in _quant_cases(device):
        rows_b, cols_b = grid.blocks_of(offset, piece.shape)  # type: ignore[attr-defined]
        amax = torch.zeros(grid.grid, dtype=torch.float32, device=device)  # type: ignore[attr-defined]
        amax[rows_b.start:rows_b.stop, cols_b.start:cols_b.stop] = fp8._torch_amax(
            piece, offset, grid, rows_b, cols_b)  # type: ignore[arg-type]
        scales = fp8.scales_from_amax(amax)
        want = fp8._torch_quantize(piece, offset, grid, scales).view(torch.uint8)  # type: ignore[arg-type]
        got = torch.full(piece.shape[::-1], 0x5A, dtype=torch.uint8, device=device).t()
        fp8._native_quantize(quant, got, piece, offset, grid, scales)  # type: ignore[arg-type]
        _compare("quantize_blocks", device, case, got, want)
