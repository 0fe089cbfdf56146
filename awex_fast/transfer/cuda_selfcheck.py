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

This module is the bottom of the self-check and knows no kernel: each kernel's check lives next
to the kernel (`boxcopy`: copy, cast, checksum; `fp8`: block_amax, quantize_blocks), built from
the comparison and sample helpers here, and that module `register`s it when it is imported.
A kernel's check is therefore there whenever the kernel can be used; a caller of `check` alone
imports the owning module first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NoReturn

import torch

__all__ = ["KERNELS", "KernelSelfCheckError", "bits", "check", "compare", "ensure", "fail", "register",
           "sample_floats", "sample_generator", "strided_views", "torch_checksum"]

KERNELS: tuple[str, ...] = ("copy", "cast", "checksum", "block_amax", "quantize_blocks")

_MASK64 = (1 << 64) - 1
_lock = threading.Lock()
_passed: set[tuple[str, int]] = set()
_failed: dict[tuple[str, int], str] = {}
_checks: dict[str, Callable[[torch.device], None]] = {}


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


def register(kernel: str, fn: Callable[[torch.device], None]) -> None:
    """Make ``fn`` the self-check of ``kernel`` (one of `KERNELS`): called with a device, it runs
    the kernel there on its sample and raises `KernelSelfCheckError` (see `fail`) on a difference.
    The module that owns the kernel calls this when it is imported."""
    if kernel not in KERNELS:
        raise ValueError(f"no self-check slot for kernel {kernel!r} (known: {', '.join(KERNELS)})")
    _checks[kernel] = fn


def check(kernel: str, device: torch.device) -> None:
    """Run ``kernel``'s native implementation on ``device`` (CPU or CUDA) on its sample and
    compare it with torch's ops there; raises `KernelSelfCheckError` on the first difference.
    The kernel's check must be registered (its module imported), else ValueError."""
    fn = _checks.get(kernel)
    if fn is None:
        raise ValueError(f"no self-check for kernel {kernel!r} (known: {', '.join(KERNELS)})")
    fn(torch.device(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- comparison ------------------------------------------------------------------------------

def fail(kernel: str, device: torch.device, case: str, detail: str) -> NoReturn:
    """Raise the `KernelSelfCheckError` of ``kernel`` on ``device`` for sample ``case``."""
    raise KernelSelfCheckError(
        f"awex_fast's native {kernel} kernel failed its self-check on {device} ({case}): {detail}; it is "
        "not used on this device (is the extension built for this GPU's architecture and this driver? "
        "rebuild it, or report this with `awex_fast.build_info()` and torch's version)")


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits, as a contiguous tensor of the signed integer dtype of its element size."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def compare(kernel: str, device: torch.device, case: str, got: torch.Tensor, want: torch.Tensor,
             nan_bits_free: bool = False) -> None:
    """Bitwise equality of ``got`` and ``want`` (same shape), else `fail` naming the first
    differing element; with ``nan_bits_free`` a NaN must meet a NaN but its bit pattern is free
    (see boxcopy's cast check)."""
    if tuple(got.shape) != tuple(want.shape):
        fail(kernel, device, case, f"shape {tuple(got.shape)}, torch's is {tuple(want.shape)}")
    same = bits(got) == bits(want)
    if nan_bits_free and got.is_floating_point():
        same |= torch.isnan(got.contiguous()) & torch.isnan(want.contiguous())
    if bool(same.all()):
        return
    index = tuple(int(i) for i in (~same).nonzero()[0])
    g, w = got.contiguous()[index], want.contiguous()[index]
    fail(kernel, device, case, f"first differing element {list(index)}: got {g.item()!r} "
          f"(bits {int(bits(g.reshape(1))[0]) & _MASK64:#x}), torch gives {w.item()!r} "
          f"(bits {int(bits(w.reshape(1))[0]) & _MASK64:#x})")


# --- samples ---------------------------------------------------------------------------------

def sample_generator() -> torch.Generator:
    """The seeded generator every sample is drawn from."""
    return torch.Generator().manual_seed(20240607)  # the same sample on every device and run


def sample_floats(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """float32 values (made on the CPU: the same on every device) over many magnitudes, with the
    special classes the casts must handle sprinkled in."""
    x = torch.randn(shape, generator=gen) * torch.logspace(-12, 6, shape[1]).to(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-40, 2.0 ** -126,
                            65504.0, 65520.0, -65536.0, 3.4e38, 448.0, 464.0, -480.0, 2.0 ** -10,
                            1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 2.0 ** -24, 2.0 ** -25])
    where = torch.randint(0, x.numel(), (4 * special.numel(),), generator=gen)
    x.view(-1)[where] = special.repeat(4)
    return x


def strided_views(base: torch.Tensor) -> list[torch.Tensor]:
    """Strided views of a 2-D tensor the kernels must walk: whole, cut, stepped, transposed."""
    return [base, base[3:50, 7:101], base[:, ::3], base.t(), base[::2, 1::5].t(), base[5:6, 2:3]]


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
