"""The destination layout of a live vLLM model, learned from vLLM's own weight loaders.

vLLM decides where each checkpoint tensor lands: fused ``qkv_proj`` / ``gate_up_proj`` / MoE
``w13``, KV-head replication when TP exceeds the KV heads, vocabulary padding, tied embeddings.
Rather than keep a table of those rules, `record_load_layout` runs the model's ``load_weights``
once on meta tensors (no memory, no data) under a `TorchDispatchMode` that watches every
``copy_`` into a parameter. The geometry of the source view (relative to the checkpoint tensor)
and of the destination view (relative to the parameter) says which box of which checkpoint
tensor lands where. Layers whose live tensors were post-processed (CPU repacking,
quantization) are first put back into their load format on the meta device, as vLLM's
layerwise reload does, so the recording describes the format the loaders write; the live
tensors are put back afterwards, untouched.

A loader that builds its source with anything but views, ``clone``/``contiguous`` or a dtype
conversion (``cat``, arithmetic, indexing) cannot be described as boxes: the recording raises
`LayoutError` naming the checkpoint tensor and the operation, before any byte moves.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LayoutError", "LoadCopy", "LoadLayout", "record_load_layout"]

_aten = torch.ops.aten
_DERIVING_OPS = {_aten.clone.default, _aten._to_copy.default}
# what a loader writes that no checkpoint holds: vocabulary padding (`VocabParallelEmbedding`
# zero-fills the rows past the real vocabulary on the last ranks), any padding a loader clears
_FILL_OPS = {_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default}
# an attention layer's quantization scalars (FP8 attention / KV cache), which checkpoints may
# omit (vLLM then uses its defaults) and no trainer trains
_OPTIONAL_SCALARS = {"q_scale", "k_scale", "v_scale", "prob_scale"}


class LayoutError(ValueError):
    """vLLM's loaders place a checkpoint tensor in a way awex_fast cannot describe, or a vLLM
    parameter is not covered by the checkpoint names offered. Names the tensor and the reason."""


@dataclass(frozen=True)
class _Axis:
    """One dimension of a view, seen in its root tensor: root dimension, first index, extent."""

    dim: int
    start: int
    size: int


@dataclass(frozen=True)
class _Box:
    """A strided view as a box of its root tensor: its own dimensions in view order (``axes``;
    ``None`` for a size-1 dimension with no root counterpart) and the root dimensions it holds
    at a single index (``fixed``: root dim -> index)."""

    axes: tuple[_Axis | None, ...]
    fixed: tuple[tuple[int, int], ...]

    def compose(self, inner: _Box) -> _Box:
        """``inner`` is a box of a tensor that is itself ``self`` (a box of the root): the same
        region seen in the root."""
        axes: list[_Axis | None] = []
        for a in inner.axes:
            if a is None:
                axes.append(None)
                continue
            outer = self.axes[a.dim]
            if outer is None:  # a size-1 dim without a root counterpart: only index 0 exists
                axes.append(None)
            else:
                axes.append(_Axis(outer.dim, outer.start + a.start, a.size))
        fixed = dict(self.fixed)
        for d, i in inner.fixed:
            outer = self.axes[d]
            if outer is not None:
                fixed[outer.dim] = outer.start + i
        return _Box(tuple(axes), tuple(sorted(fixed.items())))

    def root_box(self, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offset, shape) of the region in the root's coordinates."""
        offset, shape = [0] * ndim, [1] * ndim
        for d, i in self.fixed:
            offset[d] = i
        for a in self.axes:
            if a is not None:
                offset[a.dim], shape[a.dim] = a.start, a.size
        return tuple(offset), tuple(shape)


def _as_box(view: torch.Tensor, root_sizes: Sequence[int], root_strides: Sequence[int],
            root_offset: int) -> _Box | None:
    """Describe ``view`` (sharing the root's storage) as a box of the root, or None when its
    strides or offset are not those of a box (a reinterpreting ``view``/``as_strided``)."""
    dims = [d for d in range(len(root_sizes)) if root_sizes[d] > 1]
    by_stride = {root_strides[d]: d for d in dims}
    if len(by_stride) != len(dims):
        return None  # overlapping root: no unique decomposition
    axes: list[_Axis | None] = []
    used: set[int] = set()
    pending_unit: list[int] = []  # view dims of size 1: placed after the others
    for e, (size, stride) in enumerate(zip(view.shape, view.stride(), strict=True)):
        if size == 1:
            axes.append(None)
            pending_unit.append(e)
            continue
        d = by_stride.get(stride)
        if d is None or d in used:
            return None
        used.add(d)
        axes.append(_Axis(d, 0, size))
    rel = view.storage_offset() - root_offset
    if rel < 0:
        return None
    starts = [0] * len(root_sizes)
    for d in sorted(dims, key=lambda d: -root_strides[d]):
        starts[d], rel = divmod(rel, root_strides[d])
    if rel:
        return None
    out_axes: list[_Axis | None] = []
    for a in axes:
        if a is None:
            out_axes.append(None)
            continue
        if starts[a.dim] + a.size > root_sizes[a.dim]:
            return None
        out_axes.append(_Axis(a.dim, starts[a.dim], a.size))
    fixed = [(d, starts[d]) for d in dims if d not in used]
    if any(i >= root_sizes[d] for d, i in fixed):
        return None
    return _Box(tuple(out_axes), tuple(fixed))


def _identity_box(t: torch.Tensor) -> _Box:
    return _Box(tuple(_Axis(d, 0, s) for d, s in enumerate(t.shape)), ())


@dataclass
class _Tracked:
    """A storage whose elements are known: ``name`` (a checkpoint tensor or a parameter), the
    tensor laid out over the storage (``base``) and where ``base`` sits in the root (``box``)."""

    name: str
    base: torch.Tensor
    box: _Box
    root_ndim: int


@dataclass(frozen=True)
class LoadCopy:
    """One ``copy_`` a loader made: the box ``[src_offset, src_offset + src_shape)`` of checkpoint
    tensor ``name`` lands in vLLM parameter ``param``. The destination, permuted into the
    checkpoint's dimension order (a size-1 checkpoint dimension the loader dropped has stride
    0), is ``param.as_strided(src_shape, dst_strides, param.storage_offset() + dst_offset)``."""

    name: str
    src_offset: tuple[int, ...]
    src_shape: tuple[int, ...]
    param: str
    dst_offset: int
    dst_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements this copy writes."""
        return math.prod(self.src_shape)


@dataclass
class LoadLayout:
    """Where every checkpoint tensor's boxes land in one worker's model (see `LoadCopy`).

    ``load_format``: qualified name -> meta tensor of each parameter as the loaders write it
    (shape, stride and dtype before post-processing). ``unused``: offered names the loaders
    ignored (tied or skipped tensors); this worker receives nothing of them. ``padding``:
    parameter -> elements its loader fills with a constant (vocabulary padding), which no
    checkpoint holds: nothing is sent for them, and they keep what vLLM's loader wrote."""

    copies: dict[str, list[LoadCopy]] = field(default_factory=dict)
    load_format: dict[str, torch.Tensor] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)  # parameter -> the one it shares storage with
    padding: dict[str, int] = field(default_factory=dict)

    def pieces(self, name: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The distinct checkpoint boxes of ``name`` this worker keeps, (offset, shape)."""
        return sorted({(c.src_offset, c.src_shape) for c in self.copies.get(name, [])})


class _Recorder(TorchDispatchMode):
    """Records every ``copy_`` from a tracked checkpoint region into a tracked parameter."""

    def __init__(self, sources: dict[int, _Tracked], targets: dict[int, _Tracked]) -> None:
        super().__init__()
        self.sources, self.targets = sources, targets
        self.tainted: dict[int, tuple[str, str]] = {}  # storage -> (checkpoint name, op)
        self.copies: list[LoadCopy] = []
        self.fills: list[tuple[str, int, int]] = []  # (parameter, first, end) a loader filled
        self.keep: list[torch.Tensor] = []  # outputs kept alive so their storage ids stay unique

    @staticmethod
    def _sid(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _locate(self, t: torch.Tensor, table: dict[int, _Tracked]) -> tuple[_Tracked, _Box | None] | None:
        """(tracked storage, the view as a box of its root; None if not a box), or None when
        ``t``'s storage is not in ``table``."""
        tracked = table.get(self._sid(t))
        if tracked is None:
            return None
        b = tracked.base
        inner = _as_box(t, b.shape, b.stride(), b.storage_offset())
        return tracked, (tracked.box.compose(inner) if inner is not None else None)

    def _record_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        sid = self._sid(src)
        if sid in self.tainted and self._sid(dst) in self.targets:
            name, op = self.tainted[sid]
            raise LayoutError(f"checkpoint tensor {name!r}: a vLLM loader builds what it copies into "
                              f"{self.targets[self._sid(dst)].name!r} with {op}, which awex_fast cannot "
                              "describe as boxes")
        src_at, dst_at = self._locate(src, self.sources), self._locate(dst, self.targets)
        if src_at is None or dst_at is None:
            return
        (s, sbox), (d, dbox) = src_at, dst_at
        if sbox is None or dbox is None:
            raise LayoutError(f"checkpoint tensor {s.name!r}: a vLLM loader copies a region into "
                              f"{d.name!r} that is not a box (src view {tuple(src.shape)} strides "
                              f"{src.stride()}, dst view {tuple(dst.shape)} strides {dst.stride()})")
        if tuple(src.shape) != tuple(dst.shape):
            raise LayoutError(f"checkpoint tensor {s.name!r}: a vLLM loader broadcasts {tuple(src.shape)} "
                              f"into {tuple(dst.shape)} of {d.name!r}")
        offset, shape = sbox.root_box(s.root_ndim)
        strides = [0] * s.root_ndim
        for a, stride in zip(sbox.axes, dst.stride(), strict=True):
            if a is not None:
                strides[a.dim] = stride
        self.copies.append(LoadCopy(s.name, offset, shape, d.name,
                                    dst.storage_offset() - d.base.storage_offset(), tuple(strides)))

    def _record_fill(self, dst: torch.Tensor) -> None:
        """A constant written into a parameter (padding), as a range of its storage; a fill that
        is not one contiguous range is not recorded, so it never counts as covered."""
        if not dst.is_contiguous() or dst.numel() == 0:
            return
        tracked = self.targets[self._sid(dst)]
        first = dst.storage_offset() - tracked.base.storage_offset()
        self.fills.append((tracked.name, first, first + dst.numel()))

    def padding(self) -> dict[str, int]:
        """Per parameter, the elements a loader filled and no copy wrote (its padding)."""
        spans: dict[str, list[tuple[int, int]]] = {}
        for c in self.copies:
            extent = sum((n - 1) * s for n, s in zip(c.src_shape, c.dst_strides, strict=True)) + 1
            spans.setdefault(c.param, []).append((c.dst_offset, c.dst_offset + extent))
        out: dict[str, int] = {}
        for name, first, end in sorted(set(self.fills)):
            if all(end <= a or first >= b for a, b in spans.get(name, [])):
                out[name] = out.get(name, 0) + end - first
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is _aten.copy_.default:
            # never executed: the probes hold no data, and a few targets stay live
            # (biases are never put on meta), which must not be touched
            self._record_copy(args[0], args[1])
            return args[0]
        if func in _FILL_OPS and self._sid(args[0]) in self.targets:
            self._record_fill(args[0])  # never executed either, for the same reason
            return args[0]
        out = func(*args, **kwargs)
        known = self.sources.keys() | self.tainted.keys()
        src = next((a for a in args if isinstance(a, torch.Tensor) and self._sid(a) in known), None)
        if src is None or not isinstance(out, torch.Tensor) or self._sid(out) == self._sid(src):
            return out  # untracked input, or a view (same storage): located at copy_ time
        self.keep.append(out)
        sid = self._sid(src)
        if func in _DERIVING_OPS and sid in self.sources:
            at = self._locate(src, self.sources)
            if at is not None and at[1] is not None:
                tracked, box = at
                # the output's dims are the input view's dims, laid out over a new storage
                self.sources[self._sid(out)] = _Tracked(tracked.name, out, box, tracked.root_ndim)
                return out
        name = self.sources[sid].name if sid in self.sources else self.tainted[sid][0]
        self.tainted[self._sid(out)] = (name, f"aten.{func.__name__}")
        return out


def _reload_info() -> dict:
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return LAYERWISE_INFO  # type: ignore[return-value]


@contextlib.contextmanager
def load_format_on_meta(model: torch.nn.Module) -> Iterator[None]:
    """Put every layer's tensors into their load format on the meta device (vLLM's recorded
    reload metadata) for the duration of the block, then put the live tensors back as they
    were (same objects, same storages)."""
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

    infos = _reload_info()
    saved = []
    try:
        for layer in model.modules():
            info = infos.get(layer)
            if info is None or not (info.restore_metadata[0] or info.restore_metadata[1]):
                continue
            saved.append((layer, dict(layer._parameters), dict(layer._buffers),
                          set(layer._non_persistent_buffers_set)))
            restore_layer_on_meta(layer, info)
            _unwrap_reload_loaders(layer)
        yield
    finally:
        for layer, params, buffers, non_persistent in saved:
            layer._parameters.clear()
            layer._parameters.update(params)
            layer._buffers.clear()
            layer._buffers.update(buffers)
            layer._non_persistent_buffers_set.clear()
            layer._non_persistent_buffers_set.update(non_persistent)


def _unwrap_reload_loaders(layer: torch.nn.Module) -> None:
    """A past layerwise reload leaves its deferring wrapper on the load-format tensors it
    registered (the objects vLLM keeps as reload metadata); a recording must run the loaders
    themselves, so peel the wrappers off (vLLM's next reload wraps them again)."""
    for t in [*layer._parameters.values(), *layer._buffers.values()]:
        loader = getattr(t, "weight_loader", None)
        if loader is None:
            continue
        while getattr(loader, "__name__", "") == "online_process_loader" and hasattr(loader, "__wrapped__"):
            loader = loader.__wrapped__
        t.weight_loader = loader


def _load_numel(t: torch.Tensor) -> int:
    return int(getattr(t, "weight_loader_numel", t.numel()))


def record_load_layout(model: torch.nn.Module, tensors: Iterable[tuple[str, Sequence[int], torch.dtype]],
                       *, require_coverage: bool = True) -> LoadLayout:
    """Run ``model.load_weights`` on meta tensors named and shaped as ``tensors`` (checkpoint
    name, global shape, dtype) and return where each box lands (`LoadLayout`).

    ``require_coverage``: every element of every loadable parameter must be written by some
    copy, less its padding: what its loader fills with a constant (vocabulary padding: vLLM
    pads the embedding and LM head to a multiple of 64 x TP rows) or declares as never loaded
    (``weight_loader_numel``). A parameter left short raises `LayoutError` naming it, since
    vLLM would serve stale or uninitialised values there. A name the model does not know, or a
    tensor whose shape its loader cannot take, raises `LayoutError` too (vLLM raises
    ``KeyError``, an assertion, or an out-of-range ``narrow``)."""
    offered = [(str(n), tuple(int(s) for s in shape), dtype) for n, shape, dtype in tensors]
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    layout = LoadLayout()
    # tied parameters (a shared embedding / LM head) are one storage: loaders fill it through
    # one name and skip the other, which must not count as uncovered
    first_by_storage: dict[int, str] = {}
    for qual, t in model.named_parameters(remove_duplicate=False):
        first = first_by_storage.setdefault(t.untyped_storage()._cdata, qual)
        if first != qual:
            layout.tied[qual] = first
    with load_format_on_meta(model):
        targets: dict[int, _Tracked] = {}
        params = {q for q, _ in model.named_parameters()}
        for qual, t in [*model.named_parameters(), *model.named_buffers()]:
            sid = t.untyped_storage()._cdata
            if sid not in targets:
                targets[sid] = _Tracked(qual, t, _identity_box(t), t.dim())
                layout.load_format[qual] = t  # meta (or never-processed live) tensor
        probes = [(n, torch.empty(shape, dtype=dtype, device="meta")) for n, shape, dtype in offered]
        sources = {p.untyped_storage()._cdata: _Tracked(n, p, _identity_box(p), p.dim()) for n, p in probes}
        recorder = _Recorder(sources, targets)
        fed: list[str] = []

        def feed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, probe in probes:
                fed.append(name)
                yield name, probe

        try:
            with recorder, torch.no_grad():
                model.load_weights(feed())
        except (KeyError, ValueError, AssertionError, IndexError, RuntimeError) as exc:
            last = fed[-1] if fed else "?"
            raise LayoutError(f"vLLM's model rejects checkpoint tensor {last!r} (the trainer's names and "
                              f"shapes must be this model's Hugging Face ones): {exc}") from None
    for c in recorder.copies:
        layout.copies.setdefault(c.name, []).append(c)
    layout.unused = [n for n, _, _ in offered if n not in layout.copies]
    layout.padding = recorder.padding()
    if require_coverage:
        _check_coverage(layout, recorder.copies, params, SKIP_LOAD_TENSORS)
    return layout


def _check_coverage(layout: LoadLayout, copies: Sequence[LoadCopy], params: set[str],
                    skipped: Collection[str]) -> None:
    """Every loadable parameter gets all its elements from the copies, except its padding."""
    written: dict[str, int] = {}
    for c in copies:
        written[c.param] = written.get(c.param, 0) + c.numel
    for qual, meta in layout.load_format.items():
        if qual not in params or qual in layout.tied or qual.rsplit(".", 1)[-1] in skipped:
            continue
        if qual.rsplit(".", 1)[-1] in _OPTIONAL_SCALARS and meta.dim() == 0:
            continue  # calibration scalars a checkpoint may omit; they keep what vLLM loaded
        pad = layout.padding.get(qual, 0)
        need = _load_numel(meta) - pad
        got = written.get(qual, 0)
        if got < need:
            padded = f" (less {pad} of padding its loader fills)" if pad else ""
            raise LayoutError(f"vLLM parameter {qual!r} ({tuple(meta.shape)}) gets {got} of its "
                              f"{need} elements{padded} from the offered checkpoint tensors; the "
                              "trainer does not send what this model needs")

