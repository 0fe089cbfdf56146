"""Batched strided copy between torch tensors, executed by the native core in one call.

``pack(views, out)`` writes many views (any strides) back to back into a 1-D tensor, casting to
``out.dtype``; ``unpack(buf, views)`` is its inverse, casting to each view's dtype. Same-dtype
copies are bitwise for any element size; casts are among float32, bfloat16 and float16 and round
exactly as ``Tensor.to`` does. The executor uses the lower-level face: `gather_program` /
`scatter_program` build a `CopyProgram` for views placed at explicit byte offsets inside a bucket
once, and `CopyProgram.run` replays it every update without rebuilding descriptors.

Everything is validated here, before any byte moves: sizes, dtype pairs, devices, bounds, and
that no two destinations overlap.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from awex_fast._native import native
from awex_fast.transfer import cuda_selfcheck as sc

_copy = native().copy
_CUDA_BUILT: bool = bool(native().build_info()["cuda"])

DESC_WORDS: int = _copy.DESC_WORDS
MAX_DIMS: int = _copy.MAX_DIMS
_SHAPE, _SSTRIDE, _DSTRIDE = 5, 5 + MAX_DIMS, 5 + 2 * MAX_DIMS

# dtype code = kind | itemsize << 8 (csrc/copy/copy.h). The dtypes with a float kind may be cast
# among each other; every other dtype is copied bitwise and only to itself. The list is the
# native core's own (``CAST_DTYPES``, name -> kind), which the planner reads too.
CAST_DTYPES: tuple[str, ...] = tuple(_copy.CAST_DTYPES)
_FLOAT_KINDS = {getattr(torch, name): kind for name, kind in _copy.CAST_DTYPES.items()}
_CASTS_AMONG = ", ".join(CAST_DTYPES)


def dtype_code(dtype: torch.dtype) -> int:
    """The native core's code for ``dtype``."""
    return _FLOAT_KINDS.get(dtype, 0) | (dtype.itemsize << 8)


def check_dtype_pair(src: torch.dtype, dst: torch.dtype, what: str = "copy") -> None:
    """Raise ValueError unless ``src`` can be copied to ``dst`` (equal, or both cast-able floats)."""
    if src != dst and not (src in _FLOAT_KINDS and dst in _FLOAT_KINDS):
        raise ValueError(
            f"{what}: unsupported dtype pair {src} -> {dst} "
            f"(casts are among {_CASTS_AMONG}; other dtypes copy only to themselves)"
        )


try:  # DTensors must be unwrapped by the caller: their data_ptr is not their local shard's.
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed
    _DTensor = None


def _check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if _DTensor is not None and isinstance(t, _DTensor):
        raise TypeError(f"{what} is a DTensor; pass its local shard (to_local()) instead")
    return t


def _device_index(t: torch.Tensor, what: str) -> int:
    if t.device.type == "cpu":
        return -1
    if t.device.type == "cuda":
        if not _CUDA_BUILT:
            raise ValueError(
                f"{what} is on {t.device} but awex_fast was built without CUDA "
                "(rebuild with AWEX_FAST_CUDA=ON on a machine with nvcc)"
            )
        return t.device.index if t.device.index is not None else torch.cuda.current_device()
    raise ValueError(f"{what} is on {t.device}; awex_fast copies CPU and CUDA tensors only")


def _squeezed(shape: Sequence[int], strides: Sequence[int]) -> tuple[list[int], list[int]]:
    """Drop size-1 dims and merge contiguous neighbours until at most MAX_DIMS remain."""
    if 1 not in shape and len(shape) <= MAX_DIMS:
        return list(shape), list(strides)
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    merged: list[tuple[int, int]] = []
    for n, s in dims:
        if merged and len(dims) > MAX_DIMS and merged[-1][1] == s * n:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    return [n for n, _ in merged], [s for _, s in merged]


_PADS = [[0] * (MAX_DIMS - n) for n in range(MAX_DIMS + 1)]


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


class CopyProgram:
    """A validated list of box copies on one device, ready to replay.

    It keeps every tensor it points into alive. Replaying is valid as long as those tensors keep
    their storage (the executor re-validates data pointers when it caches programs).
    ``streaming`` marks destinations that are not read again soon (weights written by an unpack
    or a direct copy): the CPU path writes their long runs with non-temporal stores.
    """

    def __init__(
        self,
        desc: np.ndarray,
        device: int,
        keep_alive: list[torch.Tensor],
        nbytes: int,
        streaming: bool = False,
    ) -> None:
        self.desc = desc
        self.device = device
        self.nbytes = nbytes
        self.streaming = streaming
        self._keep_alive = keep_alive
        # The CUDA kernel paths this program takes (bitwise copies, casts), each self-checked on
        # the device before its first run (`_check_copy`, `_check_cast` below); CPU: none.
        self._unchecked: tuple[str, ...] = ()
        if device >= 0 and desc.shape[0]:
            casts = desc[:, 3] != desc[:, 4]
            self._unchecked = (("copy",) if not casts.all() else ()) + (("cast",) if casts.any() else ())

    @property
    def num_boxes(self) -> int:
        """Number of descriptors (boxes) in the program."""
        return int(self.desc.shape[0])

    def run(self, stream: int | None = None) -> None:
        """Execute the copies. On CUDA they are queued on ``stream`` (a raw cudaStream_t integer;
        default: torch's current stream of the device); on the CPU the call returns when done."""
        if self.desc.shape[0] == 0:
            return
        if self._unchecked:
            for kernel in self._unchecked:
                sc.ensure(kernel, self.device)
            self._unchecked = ()
        if self.device >= 0 and stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        _copy.copy_boxes(self.desc, self.device, int(stream or 0), self.streaming)


def _program(
    boxes: Sequence[torch.Tensor],
    buf: torch.Tensor,
    byte_offsets: Sequence[int],
    dtype: torch.dtype | Sequence[torch.dtype],
    to_buffer: bool,
    check_overlap: bool,
) -> CopyProgram:
    what = "pack" if to_buffer else "unpack"
    buf = _check_tensor(buf, f"{what} buffer")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"{what}: the buffer must be a contiguous 1-D tensor, got shape {tuple(buf.shape)}")
    if len(byte_offsets) != len(boxes):
        raise ValueError(f"{what}: {len(boxes)} views but {len(byte_offsets)} byte offsets")
    wire_dtypes = [dtype] * len(boxes) if isinstance(dtype, torch.dtype) else list(dtype)
    if len(wire_dtypes) != len(boxes):
        raise ValueError(f"{what}: {len(boxes)} views but {len(wire_dtypes)} buffer dtypes")
    device = _device_index(buf, f"{what} buffer")
    base, limit = buf.data_ptr(), buf.numel() * buf.element_size()
    # One flat list, one numpy conversion: this loop is the whole Python cost of a pack, so it
    # checks each view with the cheapest test first and falls back to the precise ones on doubt.
    words: list[int] = []
    checked_pairs: set[tuple[torch.dtype, torch.dtype]] = set()
    buf_device = buf.device
    total = 0
    for i, (view, offset, wire) in enumerate(zip(boxes, byte_offsets, wire_dtypes, strict=True)):
        if type(view) is not torch.Tensor and type(view) is not torch.nn.Parameter:
            _check_tensor(view, f"{what} view {i}")
        vdtype = view.dtype
        pair = (vdtype, wire) if to_buffer else (wire, vdtype)
        if pair not in checked_pairs:
            check_dtype_pair(*pair, what=f"{what} view {i}")
            checked_pairs.add(pair)
        if view.device != buf_device:
            _device_index(view, f"{what} view {i}")
            raise ValueError(f"{what}: view {i} is on {view.device} but the buffer is on {buf_device}")
        itemsize = wire.itemsize
        nbytes = view.numel() * itemsize
        if offset < 0 or offset + nbytes > limit:
            raise ValueError(
                f"{what}: view {i} ({nbytes} bytes at byte offset {offset}) does not fit in the "
                f"{limit}-byte buffer"
            )
        if offset % itemsize:
            raise ValueError(f"{what}: byte offset {offset} of view {i} is not a multiple of {itemsize}")
        shape, strides = _squeezed(view.shape, view.stride())
        ndim = len(shape)
        if ndim > MAX_DIMS:
            raise ValueError(f"{what}: view {i} has {view.dim()} non-mergeable dims (at most {MAX_DIMS})")
        packed = _contiguous_strides(shape)
        pad = _PADS[ndim]
        vcode, code = dtype_code(vdtype), dtype_code(wire)
        if to_buffer:
            words += (view.data_ptr(), base + offset, ndim, vcode, code)
            words += shape + pad + strides + pad + packed + pad
        else:
            words += (base + offset, view.data_ptr(), ndim, code, vcode)
            words += shape + pad + packed + pad + strides + pad
        total += nbytes
    desc = np.array(words, dtype=np.int64).reshape(len(boxes), DESC_WORDS)
    if check_overlap:
        _raise_on_overlap(desc, what, "byte ranges of the buffer" if to_buffer else "destination views")
    # An unpack writes weights (read later by the model, not now); a pack writes a buffer that
    # is sent next, and should stay in cache for that.
    return CopyProgram(desc, device, [buf, *boxes], total, streaming=not to_buffer)


def _raise_on_overlap(desc: np.ndarray, what: str, target: str) -> None:
    i, j = _copy.dst_overlap(desc)
    if i >= 0:
        raise ValueError(
            f"{what}: overlapping {target}: view {i} and view {j}"
            if i != j
            else f"{what}: view {i} overlaps itself"
        )


def direct_program(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], streaming: bool = True
) -> CopyProgram:
    """Program copying each ``srcs[i]`` into ``dsts[i]`` (same shapes, any strides, cast to the
    destination dtype) with no buffer in between: self-sends and colocated copies. Pass
    ``streaming=False`` when the destinations are read right after (a buffer about to be sent)."""
    if len(srcs) != len(dsts):
        raise ValueError(f"copy: {len(srcs)} sources but {len(dsts)} destinations")
    words: list[int] = []
    device: int | None = None
    keep: list[torch.Tensor] = []
    total = 0
    for i, (src, dst) in enumerate(zip(srcs, dsts, strict=True)):
        src, dst = _check_tensor(src, f"copy source {i}"), _check_tensor(dst, f"copy destination {i}")
        if src.shape != dst.shape:
            raise ValueError(
                f"copy {i}: source shape {tuple(src.shape)} != destination shape {tuple(dst.shape)}"
            )
        check_dtype_pair(src.dtype, dst.dtype, what=f"copy {i}")
        d_src, d_dst = _device_index(src, f"copy source {i}"), _device_index(dst, f"copy destination {i}")
        if d_src != d_dst or (device is not None and d_src != device):
            raise ValueError(f"copy {i}: all sources and destinations must be on one device")
        device = d_src
        # Merge dims jointly: a dim may only be dropped or merged if both sides allow it.
        dims = [(n, a, b) for n, a, b in zip(src.shape, src.stride(), dst.stride(), strict=True) if n != 1]
        if len(dims) > MAX_DIMS:
            raise ValueError(f"copy {i}: more than {MAX_DIMS} non-trivial dims")
        ndim = len(dims)
        pad = _PADS[ndim]
        words += (src.data_ptr(), dst.data_ptr(), ndim, dtype_code(src.dtype), dtype_code(dst.dtype))
        words += [n for n, _, _ in dims] + pad + [a for _, a, _ in dims] + pad + [b for _, _, b in dims] + pad
        keep += (src, dst)
        total += dst.numel() * dst.element_size()
    desc = np.array(words, dtype=np.int64).reshape(len(srcs), DESC_WORDS)
    _raise_on_overlap(desc, "copy", "destinations")
    return CopyProgram(desc, -1 if device is None else device, keep, total, streaming=streaming)


def gather_program(
    views: Sequence[torch.Tensor],
    buf: torch.Tensor,
    byte_offsets: Sequence[int],
    dtype: torch.dtype | Sequence[torch.dtype],
) -> CopyProgram:
    """Program that writes each view, cast to ``dtype`` (one for all, or one per view),
    contiguously at its byte offset of ``buf`` (a contiguous 1-D tensor of any dtype, usually
    uint8). Overlapping target ranges raise."""
    return _program(views, buf, byte_offsets, dtype, to_buffer=True, check_overlap=True)


def scatter_program(
    buf: torch.Tensor,
    byte_offsets: Sequence[int],
    dtype: torch.dtype | Sequence[torch.dtype],
    views: Sequence[torch.Tensor],
) -> CopyProgram:
    """Program that reads each view's elements (stored as ``dtype``) from its byte offset of
    ``buf`` and writes them into the view, cast to the view's dtype. Overlapping views raise."""
    return _program(views, buf, byte_offsets, dtype, to_buffer=False, check_overlap=True)


def pack_at(
    views: Sequence[torch.Tensor], buf: torch.Tensor, byte_offsets: Sequence[int], dtype: torch.dtype
) -> None:
    """Gather ``views`` into ``buf`` at explicit byte offsets, cast to ``dtype``."""
    gather_program(views, buf, byte_offsets, dtype).run()


def unpack_at(
    buf: torch.Tensor, byte_offsets: Sequence[int], dtype: torch.dtype, views: Sequence[torch.Tensor]
) -> None:
    """Scatter ``dtype`` elements at explicit byte offsets of ``buf`` into ``views``."""
    scatter_program(buf, byte_offsets, dtype, views).run()


def _back_to_back(views: Sequence[torch.Tensor], flat: torch.Tensor, what: str) -> list[int]:
    flat = _check_tensor(flat, f"{what} buffer")
    if flat.dim() != 1:
        raise ValueError(f"{what}: the buffer must be 1-D, got shape {tuple(flat.shape)}")
    sizes = [_check_tensor(v, f"{what} view {i}").numel() for i, v in enumerate(views)]
    if sum(sizes) != flat.numel():
        raise ValueError(f"{what}: the views hold {sum(sizes)} elements but the buffer holds {flat.numel()}")
    offsets, acc = [], 0
    for n in sizes:
        offsets.append(acc * flat.element_size())
        acc += n
    return offsets


def pack(views: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Write ``views`` back to back, in order, into the 1-D tensor ``out`` (no padding), casting
    to ``out.dtype``. ``out.numel()`` must equal the views' total element count."""
    offsets = _back_to_back(views, out, "pack")
    if len(views) == 0:
        return
    # Back-to-back offsets cannot overlap: skip the check gather_program makes.
    _program(views, out, offsets, out.dtype, to_buffer=True, check_overlap=False).run()


def unpack(buf: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    """Inverse of `pack`: read ``buf`` back to back into ``views``, casting to each view's dtype."""
    offsets = _back_to_back(views, buf, "unpack")
    if len(views) == 0:
        return
    scatter_program(buf, offsets, buf.dtype, views).run()


def checksum(buf: torch.Tensor, nbytes: int | None = None, stream: int | None = None) -> int:
    """64-bit positional checksum of the first ``nbytes`` bytes of a contiguous tensor, computed
    natively (on the GPU for CUDA tensors); equal bytes give equal values on any device."""
    buf = _check_tensor(buf, "checksum buffer")
    if not buf.is_contiguous():
        raise ValueError("checksum: the buffer must be contiguous")
    size = buf.numel() * buf.element_size()
    nbytes = size if nbytes is None else nbytes
    if not 0 <= nbytes <= size:
        raise ValueError(f"checksum: {nbytes} bytes asked of a {size}-byte buffer")
    device = _device_index(buf, "checksum buffer")
    if device >= 0:
        sc.ensure("checksum", device)  # once per device (cached)
        if stream is None:
            stream = torch.cuda.current_stream(device).cuda_stream
    return int(_copy.checksum(buf.data_ptr(), nbytes, device, int(stream or 0)))


def set_num_threads(n: int) -> None:
    """Threads used by CPU copies and checksums. Default: ``AWEX_COPY_THREADS`` when set, else the
    CPUs this process may use divided by ``LOCAL_WORLD_SIZE`` (the ranks sharing this host, as
    torchrun sets it), or all of them when the process is already pinned to fewer than the host's."""
    _copy.set_num_threads(int(n))


def num_threads() -> int:
    """Threads currently used by CPU copies."""
    return int(_copy.num_threads())


# --- the kernels' self-checks (awex_fast.transfer.cuda_selfcheck) ---------------------------

def _raw_copy(program: CopyProgram, device: torch.device) -> None:
    """Run a CopyProgram's descriptors straight through the kernel (no self-check: this is it)."""
    index = -1 if device.type == "cpu" else device.index
    stream = 0 if index < 0 else int(torch.cuda.current_stream(index).cuda_stream)
    _copy.copy_boxes(program.desc, index, stream, program.streaming)


def _pack_unpack(kernel: str, device: torch.device, views: list[torch.Tensor], wire: torch.dtype,
                 case: str, nan_bits_free: bool) -> None:
    sizes = [v.numel() for v in views]
    buf = torch.full((sum(sizes) * wire.itemsize,), 0x5A, dtype=torch.uint8, device=device)
    offsets = [sum(sizes[:i]) * wire.itemsize for i in range(len(views))]
    _raw_copy(gather_program(views, buf, offsets, wire), device)
    want = torch.cat([v.reshape(-1).to(wire) for v in views])
    sc.compare(kernel, device, f"{case}: pack to {wire}", buf.view(wire), want, nan_bits_free)
    # back into transposed (strided) destinations of the views' own dtype
    targets = [torch.zeros(v.shape[::-1], dtype=v.dtype, device=device).t() for v in views]
    _raw_copy(scatter_program(buf, offsets, wire, targets), device)
    for k, (got, v) in enumerate(zip(targets, views, strict=True)):
        sc.compare(kernel, device, f"{case}: unpack view {k} from {wire}", got, v.to(wire).to(v.dtype),
                   nan_bits_free)


def _check_copy(device: torch.device) -> None:
    """Bitwise copies (same dtype on both sides) of strided views of several element sizes."""
    gen = sc.sample_generator()
    raw = torch.randint(0, 256, (97, 130), generator=gen, dtype=torch.uint8)
    for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.int64):
        base = raw if dtype == torch.uint8 else torch.randint(
            0, 256, (97, 130 * dtype.itemsize), generator=gen, dtype=torch.uint8).view(dtype)
        _pack_unpack("copy", device, sc.strided_views(base.to(device)), dtype, f"{dtype} views",
                     nan_bits_free=False)


def _check_cast(device: torch.device) -> None:
    """Every cast among float32 / bfloat16 / float16, against ``Tensor.to``. A NaN must stay a NaN
    but its payload is not compared: torch's own CPU kernels give different NaN bits in their
    vectorised and scalar loops, and no value depends on them."""
    gen = sc.sample_generator()
    values = sc.sample_floats((61, 130), gen)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    for src in floats:
        base = values.to(src).to(device)
        for wire in floats:
            if wire != src:
                _pack_unpack("cast", device, sc.strided_views(base), wire, f"{src} views", nan_bits_free=True)


def _check_checksum(device: torch.device) -> None:
    """The positional checksum of byte ranges of several lengths (a partial last word included)."""
    gen = sc.sample_generator()
    data = torch.randint(0, 256, (3 * 65536 + 13,), generator=gen, dtype=torch.uint8).to(device)
    index = -1 if device.type == "cpu" else device.index
    for n in (0, 7, 8, 4099, data.numel()):
        stream = 0 if index < 0 else int(torch.cuda.current_stream(index).cuda_stream)
        got = int(_copy.checksum(data.data_ptr(), n, index, stream))
        want = sc.torch_checksum(data, n)
        if got != want:
            sc.fail("checksum", device, f"{n} bytes", f"got {got:#018x}, torch gives {want:#018x}")


sc.register("copy", _check_copy)
sc.register("cast", _check_cast)
sc.register("checksum", _check_checksum)


__all__ = [
    "CAST_DTYPES",
    "CopyProgram",
    "check_dtype_pair",
    "checksum",
    "direct_program",
    "dtype_code",
    "gather_program",
    "num_threads",
    "pack",
    "pack_at",
    "scatter_program",
    "set_num_threads",
    "unpack",
    "unpack_at",
]
