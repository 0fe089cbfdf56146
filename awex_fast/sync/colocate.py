"""Colocated weight sync: training and inference share a host or a GPU node.

Why a separate path: when both sides can address the same memory, a transport only adds copies.
The training side publishes *handles* to its parameter storage; every inference rank maps the
handles of the training ranks it reads from and copies its boxes directly with one native batched
copy (`awex_fast.transfer.boxcopy.direct_program`), then acknowledges. Nothing crosses a process as pickle: a
handle is JSON.

- **CPU**: POSIX shared memory (awex_fast.transport.shm). A handle is ``{"kind": "shm", "name",
  "size"}``. Training tensors must live in such a segment: `share_tensors` moves them there once
  (the training adapter rebinds plain module parameters to the shared copies).
- **CUDA**: CUDA IPC through the native core (csrc/nccl/ipc.cpp). A handle is
  ``{"kind": "cuda_ipc", "handle": base64 of the 64-byte cudaIpcMemHandle_t, "size", "uuid"}``
  for the whole allocation that holds a tensor (PyTorch's caching allocator sub-allocates
  segments; the base comes from cuMemGetAddressRange); each tensor records its byte offset in
  it. Mapped on the importer's device with lazy peer access, so the GPUs of one node can read
  each other's weights (a peer device is copied per box with torch; the same device in one
  native launch). PyTorch's ``expandable_segments`` allocator cannot export IPC handles.

Protocol of one update ``version`` (docs/DESIGN.md, "KV keys", per pair)::

    training rank r   put  colocate_weights_rank{r}_{version} = {"format", "device", "epoch",
                           "handles_version", "segments", "tensors"}
                      "segments"/"tensors" are the full handle list only when some storage
                      pointer changed since the last publication (a new "epoch"); otherwise they
                      are null and "handles_version" names the version whose value holds them.
                      Then wait until the set colocate_done_rank{r}_{version} has one member
                      per inference rank that reads from r; only then may memory be released.
    inference rank i  wait for that key of every training rank it reads from, map the handles
                      (mappings are cached per (rank, epoch) and dropped when a new epoch
                      arrives), copy, synchronise, add str(i) to colocate_done_rank{r}_{version}.

Memory release (``release_memory`` / ``resume_memory``) lives in awex_fast.sync.memory.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from awex_fast._native import native
from awex_fast.meta import dtype_name
from awex_fast.transfer import boxcopy as afc
from awex_fast.transport.shm import SegmentError, SharedSegment, create_segment, find_segment, open_segment

if TYPE_CHECKING:
    from awex_fast.plan.planner import RankPlan

HANDLES_FORMAT = "awex_fast.sync.colocate/1"
_ALIGN = 64  # byte alignment of tensors inside a shared segment


class ColocateError(RuntimeError):
    """A colocated update could not map, find or copy weights; names the rank and the tensor."""


def weights_key(rank: int, version: int) -> str:
    """KV key of training rank ``rank``'s handles for ``version`` (docs/DESIGN.md, "KV keys")."""
    return f"colocate_weights_rank{rank}_{version}"


def done_key(rank: int, version: int) -> str:
    """KV set of the inference ranks that finished reading training rank ``rank``
    (docs/DESIGN.md, "KV keys")."""
    return f"colocate_done_rank{rank}_{version}"


def share_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[SharedSegment, dict[str, torch.Tensor]]:
    """Copy CPU ``tensors`` into one new shared segment (each contiguous, 64-byte aligned) and
    return it with the shared copies, same names, shapes and dtypes."""
    offsets, total = {}, 0
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(
                f"share_tensors: tensor {name!r} is on {t.device}; shared memory holds CPU tensors"
            )
        offsets[name] = total
        total += (t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
    seg = create_segment(max(total, 1))
    out = {}
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        view = seg.tensor[offsets[name] : offsets[name] + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[name] = view
    return seg, out


# --------------------------------------------------------------------------------------------
# CUDA IPC (native core)
# --------------------------------------------------------------------------------------------


def _ipc() -> Any:
    ipc = getattr(native(), "ipc", None)
    if ipc is None or not ipc.available():
        raise ColocateError(
            "CUDA IPC needs awex_fast built with CUDA (AWEX_FAST_CUDA=ON) and the ipc bindings "
            "registered in csrc/bindings.cpp"
        )
    return ipc


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


class _CudaBuffer:
    """A raw device range exposed through ``__cuda_array_interface__`` (uint8, 1-D)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2, "strides": None}


@dataclass
class _CudaMapping:
    base: int
    size: int
    device: int
    tensor: torch.Tensor

    def close(self) -> None:
        del self.tensor
        _ipc().close_handle(self.base, self.device)


def _open_cuda(handle: Mapping[str, Any], device: int) -> _CudaMapping:
    raw = base64.b64decode(handle["handle"])
    ptr = int(_ipc().open_handle(raw, device))
    size = int(handle["size"])
    with torch.cuda.device(device):
        tensor = torch.as_tensor(_CudaBuffer(ptr, size), device=f"cuda:{device}")
    return _CudaMapping(ptr, size, device, tensor)


# --------------------------------------------------------------------------------------------
# Handles
# --------------------------------------------------------------------------------------------


def _signature(tensors: Mapping[str, torch.Tensor]) -> tuple:
    return tuple((n, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))
                 for n, t in sorted(tensors.items()))


def build_handles(tensors: Mapping[str, torch.Tensor], rank: int) -> dict[str, Any]:
    """The handle description of ``tensors`` (all CPU in live shared segments, or all CUDA):
    ``{"device", "segments": [handle, ...], "tensors": {name: {"segment", "offset", "dtype",
    "shape", "stride"}}}``. Raises `ColocateError` naming the tensor that cannot be shared."""
    devices = {t.device.type for t in tensors.values()}
    if len(devices) > 1:
        raise ColocateError(f"training rank {rank}: tensors live on several device types {sorted(devices)}")
    device = devices.pop() if devices else "cpu"
    segments: list[dict[str, Any]] = []
    index: dict[Any, int] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, t in sorted(tensors.items()):
        if t.numel() == 0:  # nothing to map: the receiver makes an empty tensor
            entries[name] = {"segment": -1, "offset": 0, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                             "stride": list(t.stride())}
            continue
        if device == "cpu":
            found = find_segment(t)
            if found is None:
                raise ColocateError(
                    f"training rank {rank}: tensor {name!r} is not in shared memory; colocated CPU mode "
                    "needs plain parameters (the adapter moves them) or tensors from share_tensors()"
                )
            seg, offset = found
            key: Any = seg.name
            if key not in index:
                index[key] = len(segments)
                segments.append(seg.handle)
        elif device == "cuda":
            info = _ipc().export_handle(t.data_ptr(), _device_index(t))
            key, offset = int(info["base"]), int(info["offset"])
            if key not in index:
                index[key] = len(segments)
                segments.append(
                    {
                        "kind": "cuda_ipc",
                        "handle": base64.b64encode(bytes(info["handle"])).decode("ascii"),
                        "size": int(info["size"]),
                        "uuid": str(info["uuid"]),
                    }
                )
        else:
            raise ColocateError(f"training rank {rank}: tensor {name!r} is on {t.device}; only CPU and CUDA")
        entries[name] = {"segment": index[key], "offset": offset, "dtype": dtype_name(t.dtype),
                "shape": list(t.shape), "stride": list(t.stride())}
    return {"device": device, "segments": segments, "tensors": entries}


def _tensor_at(bufs: Sequence[torch.Tensor], entry: Mapping[str, Any], what: str,
               device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ColocateError(f"{what}: unknown dtype {entry['dtype']!r}")
    shape, stride, offset = list(entry["shape"]), list(entry["stride"]), int(entry["offset"])
    if 0 in shape or entry["segment"] < 0:
        return torch.empty(shape, dtype=dtype, device=device)
    if not 0 <= entry["segment"] < len(bufs):
        raise ColocateError(f"{what}: segment {entry['segment']} of {len(bufs)} published")
    buf = bufs[entry["segment"]]
    span = (1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))) * dtype.itemsize
    if offset < 0 or offset + span > buf.numel():
        raise ColocateError(f"{what}: {span} bytes at offset {offset} exceed the {buf.numel()}-byte segment")
    return buf[offset : offset + span].view(dtype).as_strided(shape, stride)


# --------------------------------------------------------------------------------------------
# Training side
# --------------------------------------------------------------------------------------------


class ColocateSender:
    """Training rank ``rank`` of a colocated pair: publishes handles, waits for acks.

    ``readers`` is the number of inference ranks whose plan reads from this rank (each acks once
    per version). ``kv`` is a `awex_fast.net.KVStoreClient`.
    """

    def __init__(self, kv: Any, pair_name: str, rank: int, readers: int, timeout_s: float) -> None:
        self.kv, self.pair, self.rank, self.readers, self.timeout_s = kv, pair_name, rank, readers, timeout_s
        self.epoch = 0
        self.handles_version: int | None = None
        self.publications = 0
        self._signature: tuple | None = None

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Put this rank's handles for ``version``; True when the full handle list was (re)built
        because this is the first publication or a storage pointer changed."""
        if any(t.device.type == "cuda" for t in tensors.values()):
            torch.cuda.synchronize()  # every write to the weights is done before anyone reads them
        sig = _signature(tensors)
        fresh = sig != self._signature
        value: dict[str, Any] = {"format": HANDLES_FORMAT, "epoch": self.epoch + fresh}
        if fresh:
            value.update(build_handles(tensors, self.rank))
            self.epoch += 1
            self.handles_version = version
            self.publications += 1
            self._signature = sig
        else:
            value.update({"device": None, "segments": None, "tensors": None})
        value["handles_version"] = self.handles_version
        self.kv.put(self.pair, weights_key(self.rank, version), value)
        return fresh

    def wait_acks(self, version: int) -> None:
        """Block until every reader acknowledged ``version``; then drop the per-version key
        unless it holds the current handles. Raises `ColocateError` after ``timeout_s``."""
        if self.readers:
            try:
                self.kv.wait_set_size(self.pair, done_key(self.rank, version), self.readers, self.timeout_s)
            except TimeoutError as exc:
                raise ColocateError(
                    f"training rank {self.rank}: {self.readers} inference rank(s) did not acknowledge "
                    f"version {version} within {self.timeout_s:.0f} s: {exc}"
                ) from exc
        if version != self.handles_version:
            self.kv.delete(self.pair, weights_key(self.rank, version))

    def forget(self) -> None:
        """Force a full publication next time (after teardown)."""
        self._signature = None


# --------------------------------------------------------------------------------------------
# Inference side
# --------------------------------------------------------------------------------------------


@dataclass
class _PeerView:
    epoch: int
    tensors: dict[str, torch.Tensor]
    mappings: list[Any] = field(default_factory=list)

    def close(self) -> None:
        self.tensors.clear()
        for m in self.mappings:
            if isinstance(m, _CudaMapping):
                m.close()
        self.mappings.clear()  # shared segments unmap when collected


@dataclass(frozen=True)
class _Box:
    name: str
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def plan_boxes(rank_plan: RankPlan) -> dict[int, list[_Box]]:
    """Per training peer, the boxes ``rank_plan`` (an inference rank's `RankPlan`) receives, each
    with its source slices (the trainer's local coordinates) and destination slices (ours)."""
    out: dict[int, list[_Box]] = {}
    for bucket in rank_plan.recvs:
        boxes = out.setdefault(bucket.peer, [])
        boxes.extend(_Box(op.name, op.src_slices(), op.dst_slices()) for op in bucket.ops)
    return dict(sorted(out.items()))


class ColocateReceiver:
    """Inference rank ``rank`` of a colocated pair: maps the training ranks' handles, copies its
    boxes in one native batched copy per device, acknowledges. ``boxes`` comes from
    `plan_boxes`; ``kv`` is a `awex_fast.net.KVStoreClient`."""

    def __init__(self, kv: Any, pair_name: str, rank: int, boxes: Mapping[int, Sequence[_Box]],
                 timeout_s: float) -> None:
        self.kv, self.pair, self.rank, self.timeout_s = kv, pair_name, rank, timeout_s
        self.boxes = {int(p): list(b) for p, b in boxes.items()}
        self.maps_opened = 0
        self._peers: dict[int, _PeerView] = {}
        self._program: tuple[tuple, Any, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    @property
    def peers(self) -> list[int]:
        """Training ranks this rank reads from."""
        return sorted(self.boxes)

    def _view(self, peer: int, value: Mapping[str, Any], device: torch.device) -> _PeerView:
        cached = self._peers.get(peer)
        if cached is not None and cached.epoch == value["epoch"]:
            return cached
        full = value
        if value.get("segments") is None:
            full = self.kv.get(self.pair, weights_key(peer, int(value["handles_version"])))
        if cached is not None:
            self._program = None
            cached.close()
            del self._peers[peer]
        bufs, maps = [], []
        for handle in full["segments"]:
            if handle["kind"] == "shm":
                try:
                    seg = open_segment(handle)
                except SegmentError as exc:  # the same message, as this module's error
                    raise ColocateError(str(exc)) from exc
                bufs.append(seg.tensor)
                maps.append(seg)
            elif handle["kind"] == "cuda_ipc":
                if device.type != "cuda":
                    raise ColocateError(f"inference rank {self.rank}: CUDA handles from training rank {peer} "
                                        f"but the local weights are on {device}")
                index = device.index if device.index is not None else torch.cuda.current_device()
                m = _open_cuda(handle, index)
                bufs.append(m.tensor)
                maps.append(m)
            else:
                raise ColocateError(
                    f"training rank {peer} published an unknown handle kind {handle['kind']!r}"
                )
            self.maps_opened += 1
        tensors = {name: _tensor_at(bufs, e, f"training rank {peer} tensor {name!r}", device)
                   for name, e in full["tensors"].items()}
        view = self._peers[peer] = _PeerView(int(value["epoch"]), tensors, maps)
        return view

    def run(self, version: int, local: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Copy every box of ``version`` into ``local`` (canonical name -> this rank's tensors)
        and acknowledge; returns {"seconds", "copy_seconds", "bytes", "maps_opened"}."""
        t0 = time.perf_counter()
        device = next(iter(local.values())).device if local else torch.device("cpu")
        epochs = []
        for peer in self.peers:
            try:
                value = self.kv.wait(self.pair, weights_key(peer, version), self.timeout_s, max_interval=0.05)
            except TimeoutError as exc:
                raise ColocateError(f"inference rank {self.rank}: training rank {peer} published no handles "
                                    f"for version {version} within {self.timeout_s:.0f} s") from exc
            epochs.append(self._view(peer, value, device).epoch)
        key = (tuple(epochs), _signature(local))
        if self._program is None or self._program[0] != key:
            self._program = (key, *self._build(local))
        _, program, peer_pairs = self._program
        t1 = time.perf_counter()
        if program is not None:
            program.run()
        for src, dst in peer_pairs:  # another GPU of the node: torch's peer copy, box by box
            dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        for peer in self.peers:
            self.kv.add_to_set(self.pair, done_key(peer, version), str(self.rank))
        nbytes = (program.nbytes if program is not None else 0) + sum(
            d.numel() * d.element_size() for _, d in peer_pairs)
        return {"seconds": time.perf_counter() - t0, "copy_seconds": t2 - t1, "bytes": nbytes,
                "maps_opened": self.maps_opened}

    def _build(self, local: Mapping[str, torch.Tensor]) -> tuple[Any,
               list[tuple[torch.Tensor, torch.Tensor]]]:
        srcs, dsts, peer_pairs = [], [], []
        for peer, boxes in self.boxes.items():
            remote = self._peers[peer].tensors
            for b in boxes:
                if b.name not in remote:
                    raise ColocateError(
                        f"inference rank {self.rank}: training rank {peer} published no tensor "
                        f"{b.name!r}, which the plan reads from it"
                    )
                if b.name not in local:
                    raise ColocateError(f"inference rank {self.rank}: no local tensor {b.name!r}")
                src, dst = remote[b.name][b.src], local[b.name][b.dst]
                if src.device != dst.device:
                    peer_pairs.append((src, dst))
                else:
                    srcs.append(src)
                    dsts.append(dst)
        program = afc.direct_program(srcs, dsts) if srcs else None
        return program, peer_pairs

    def close(self) -> None:
        """Drop every mapping (teardown)."""
        self._program = None
        for view in self._peers.values():
            view.close()
        self._peers.clear()




__all__ = ["HANDLES_FORMAT", "ColocateError", "ColocateReceiver", "ColocateSender", "build_handles",
           "done_key", "plan_boxes", "share_tensors", "weights_key"]
