"""Colocated weight sync (training and inference share a host or a GPU node) and memory release.

Why a separate path: when both sides can address the same memory, a transport only adds copies.
The training side publishes *handles* to its parameter storage; every inference rank maps the
handles of the training ranks it reads from and copies its boxes directly with one native batched
copy (`awex_fast.transfer.boxcopy.direct_program`), then acknowledges. Nothing crosses a process as pickle: a
handle is JSON.

- **CPU**: POSIX shared memory. A handle is ``{"kind": "shm", "name", "size"}``. On Linux
  shm_open(3) is a file under /dev/shm; segments are created and opened here with ``os.open`` +
  ``mmap`` rather than ``multiprocessing.shared_memory``, whose resource tracker (Python < 3.13)
  unlinks a segment when any process that merely *attached* to it exits. Training tensors must
  live in such a segment: `share_tensors` moves them there once (the training adapter rebinds
  plain module parameters to the shared copies).
- **CUDA**: CUDA IPC through the native core (csrc/nccl/ipc.cpp). A handle is
  ``{"kind": "cuda_ipc", "handle": base64 of the 64-byte cudaIpcMemHandle_t, "size", "uuid"}``
  for the whole allocation that holds a tensor (PyTorch's caching allocator sub-allocates
  segments; the base comes from cuMemGetAddressRange); each tensor records its byte offset in
  it. Mapped on the importer's device with lazy peer access, so the GPUs of one node can read
  each other's weights (a peer device is copied per box with torch; the same device in one
  native launch). PyTorch's ``expandable_segments`` allocator cannot export IPC handles.

Protocol of one update ``version`` (KV keys of DESIGN.md, per pair)::

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

`OffloadStore` implements ``release_memory`` / ``resume_memory``: storages are saved and freed
for real (CPU: to files in a temporary directory, with the page cache dropped; shared segments
have their pages punched out with MADV_REMOVE, which frees them for every process mapping them;
CUDA: to pinned host memory, then ``torch.cuda.empty_cache``), and restored bit-identically.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import fcntl
import itertools
import mmap
import os
import re
import secrets
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from awex_fast._native import native
from awex_fast.meta import dtype_name
from awex_fast.transfer import boxcopy as afc

SHM_DIR = "/dev/shm"
HANDLES_FORMAT = "awex_fast.sync.colocate/1"
_ALIGN = 64  # byte alignment of tensors inside a shared segment
_PAGE = mmap.PAGESIZE


class ColocateError(RuntimeError):
    """A colocated update could not map, find or copy weights; names the rank and the tensor."""


def weights_key(rank: int, version: int) -> str:
    """KV key of training rank ``rank``'s handles for ``version`` (DESIGN.md)."""
    return f"colocate_weights_rank{rank}_{version}"


def done_key(rank: int, version: int) -> str:
    """KV set of the inference ranks that finished reading training rank ``rank`` (DESIGN.md)."""
    return f"colocate_done_rank{rank}_{version}"


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc/self/statm), shared pages included."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


# --------------------------------------------------------------------------------------------
# POSIX shared memory
# --------------------------------------------------------------------------------------------

_SEGMENTS: weakref.WeakValueDictionary[int, SharedSegment] = weakref.WeakValueDictionary()
_SEGMENTS_LOCK = threading.Lock()


def _unlink_quietly(path: str, lock_fd: int | None = None) -> None:
    """Remove ``path`` if it exists, then drop the owner lock held on it (if any)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    if lock_fd is not None:
        os.close(lock_fd)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, killed but not yet reaped by its parent, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True  # cannot tell: let the caller's timeout decide
    return state not in (b"Z", b"X")


_OWNER_PID = re.compile(r"_p(\d+)_")


def reap_orphans(prefix: str, min_age_s: float) -> list[str]:
    """Unlink every segment ``/dev/shm/<prefix>*`` whose owner is gone; returns their names.

    For segments made with ``owner_lock`` and named ``..._p<owner pid>_...``. One is an orphan
    when its owner pid does not run here, nobody holds its owner lock (the kernel released it
    when the owner died: this protects a live owner in another PID namespace that shares
    /dev/shm), and it is at least ``min_age_s`` old (which covers the instant between a
    creator's ``open`` and its ``flock``). Names without an owner pid are left alone.
    """
    reaped = []
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except FileNotFoundError:
        return reaped
    for name in names:
        found = _OWNER_PID.search(name)
        if found is None or pid_alive(int(found.group(1))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone already, or not ours to open
            continue
        try:
            if time.time() - os.fstat(fd).st_ctime < min_age_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            reaped.append(name)
        except OSError:  # the lock is held (its owner lives) or another reaper was first
            continue
        finally:
            os.close(fd)
    return reaped


class SharedSegment:
    """One POSIX shared-memory segment mapped read-write into this process.

    ``create=True`` makes a new segment (``name`` must not exist) and unlinks it when the object
    is collected or the process exits normally (a killed process leaves /dev/shm/<name> behind).
    With ``owner_lock`` the creator also holds a shared ``flock`` on the file until it unlinks
    it: the kernel drops the lock when the process dies, however it dies, so `reap_orphans`
    can tell a segment whose owner is gone from one that is in use (across PID namespaces too).
    ``tensor`` is a uint8 tensor over the whole mapping. Tensors made from it point into the
    mapping: keep the segment alive while they are used (the mapping is never unmapped while this
    object lives).
    """

    def __init__(self, name: str, size: int, *, create: bool, owner_lock: bool = False) -> None:
        if not name or "/" in name:
            raise ValueError(f"shared segment name {name!r} must be non-empty and contain no '/'")
        if size < 1:
            raise ValueError(f"shared segment {name!r}: size must be >= 1 byte, got {size}")
        self.name, self.size, self.owner = name, int(size), create
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise ColocateError(
                f"shared segment {name!r} does not exist (was it released or unlinked?)"
            ) from None
        lock_fd = None
        try:
            if create and owner_lock:
                fcntl.flock(fd, fcntl.LOCK_SH)  # first thing after creation: see reap_orphans
                lock_fd, fd = fd, os.dup(fd)
            held = self.size if create else os.fstat(fd).st_size
            if create:
                os.ftruncate(fd, self.size)
            self._mmap = mmap.mmap(fd, self.size) if held >= self.size else None
        except BaseException:
            if create:
                _unlink_quietly(self.path, lock_fd)
            raise
        finally:
            os.close(fd)
        if self._mmap is None:
            raise ColocateError(f"shared segment {name!r} holds {held} bytes, the handle says {self.size}")
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.base = self.tensor.data_ptr()
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path, lock_fd) if create else None
        with _SEGMENTS_LOCK:
            _SEGMENTS[self.base] = self

    @property
    def handle(self) -> dict[str, Any]:
        """The JSON handle another process opens with `open_segment`."""
        return {"kind": "shm", "name": self.name, "size": self.size}

    def contains(self, ptr: int, nbytes: int) -> bool:
        """True when ``[ptr, ptr + nbytes)`` lies inside the mapping."""
        return self.base <= ptr and ptr + nbytes <= self.base + self.size

    def punch(self) -> None:
        """Free every page of the segment (MADV_REMOVE): RAM goes back to the system for every
        process that maps it; the mapping stays valid and reads zeros until written again."""
        self._mmap.madvise(mmap.MADV_REMOVE, 0, (self.size + _PAGE - 1) // _PAGE * _PAGE)

    def unlink(self) -> None:
        """Remove the name (the memory lives on while some process maps it)."""
        if self._finalizer is not None:
            self._finalizer()
        else:
            _unlink_quietly(self.path)


def create_segment(size: int, prefix: str = "awex_fast") -> SharedSegment:
    """A new shared segment of at least ``size`` bytes (rounded up to whole pages)."""
    size = max(_PAGE, (int(size) + _PAGE - 1) // _PAGE * _PAGE)
    return SharedSegment(f"{prefix}_{os.getpid()}_{secrets.token_hex(8)}", size, create=True)


def open_segment(handle: Mapping[str, Any]) -> SharedSegment:
    """Map the segment a `SharedSegment.handle` names."""
    if handle.get("kind") != "shm":
        raise ColocateError(f"not a shared-memory handle: {dict(handle)}")
    return SharedSegment(str(handle["name"]), int(handle["size"]), create=False)


def find_segment(t: torch.Tensor) -> tuple[SharedSegment, int] | None:
    """(segment, byte offset of ``t``'s first element) when ``t``'s memory lies in a live segment
    of this process, else None."""
    ptr, span = t.data_ptr(), _span_bytes(t)
    with _SEGMENTS_LOCK:
        segments = list(_SEGMENTS.values())
    for seg in segments:
        if seg.contains(ptr, span):
            return seg, ptr - seg.base
    return None


def _span_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()


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
    per version). ``kv`` is a `awex_fast.net.kvstore.KVStoreClient`.
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


def plan_boxes(rank_plan: Any) -> dict[int, list[_Box]]:
    """Per training peer, the boxes ``rank_plan`` (an inference rank's `RankPlan`) receives, each
    with its source slices (the trainer's local coordinates) and destination slices (ours)."""
    from awex_fast.plan import planner as P

    out: dict[int, list[_Box]] = {}
    d, b0 = rank_plan.max_ndim, P.OP_BOXES
    for row in rank_plan.ops.tolist():
        if row[P.OP_KIND] != P.RECV:
            continue
        nd = row[P.OP_NDIM]
        src, dst, shape = row[b0 : b0 + nd], row[b0 + d : b0 + d + nd], row[b0 + 2 * d : b0 + 2 * d + nd]
        out.setdefault(row[P.OP_PEER], []).append(
            _Box(rank_plan.names[row[P.OP_PARAM]],
                 tuple(slice(o, o + n) for o, n in zip(src, shape, strict=True)),
                 tuple(slice(o, o + n) for o, n in zip(dst, shape, strict=True)))
        )
    return dict(sorted(out.items()))


class ColocateReceiver:
    """Inference rank ``rank`` of a colocated pair: maps the training ranks' handles, copies its
    boxes in one native batched copy per device, acknowledges. ``boxes`` comes from
    `plan_boxes`; ``kv`` is a `awex_fast.net.kvstore.KVStoreClient`."""

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
                seg = open_segment(handle)
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


# --------------------------------------------------------------------------------------------
# release_memory / resume_memory
# --------------------------------------------------------------------------------------------


@dataclass
class _Saved:
    obj: Any  # SharedSegment or torch.UntypedStorage
    nbytes: int
    device: torch.device
    path: str | None = None  # CPU: the file holding the bytes
    host: torch.Tensor | None = None  # CUDA: pinned copy


def _bytes_of(storage: Any, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


def _host_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview, through ctypes: going
    through ``t.numpy()`` would mark the storage non-resizable for good."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def _write_all(path: str, data: memoryview, drop_cache: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done : done + (1 << 30)])
        if drop_cache:  # the bytes must live on disk, not in the page cache, for RAM to be free
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_all(path: str, out: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(out):
            n = f.readinto(out[done:])
            if not n:
                raise ColocateError(f"offload file {path} ended after {done} of {len(out)} bytes")
            done += n


class OffloadStore:
    """Frees the memory behind tensors and restores it bit-identically, per tag.

    ``release(tag, tensors, keep=True)``: every distinct storage behind ``tensors`` is saved
    (``keep``; CPU: one file per storage under ``directory``, default a new temporary directory;
    CUDA: pinned host memory) and freed: a shared segment's pages are punched out, any other
    storage is resized to 0 bytes (tensors and views keep their objects; the data pointer changes
    on resume). ``resume(tag)`` reallocates and copies the bytes back (``keep=False`` leaves the
    contents undefined: for buffers that the next update overwrites). Put the directory on a disk,
    not a tmpfs, or the "released" bytes stay in RAM.
    """

    def __init__(self, directory: str | None = None, *, drop_cache: bool = True) -> None:
        self._directory = directory
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.drop_cache = drop_cache
        self._saved: dict[str, list[_Saved]] = {}
        self._counter = itertools.count()

    def _dir(self) -> str:
        if self._directory is not None:
            os.makedirs(self._directory, exist_ok=True)
            return self._directory
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="awex_fast_offload_")
        return self._tmp.name

    @property
    def released_tags(self) -> set[str]:
        """Tags currently released."""
        return set(self._saved)

    def release(self, tag: str, tensors: Iterable[torch.Tensor], *, keep: bool = True) -> int:
        """Save (if ``keep``) and free the storages behind ``tensors``; returns the bytes freed.
        A tag already released raises ValueError."""
        if tag in self._saved:
            raise ValueError(f"release_memory: tag {tag!r} is already released")
        entries: list[_Saved] = []
        seen: set[int] = set()
        for t in tensors:
            found = find_segment(t) if t.device.type == "cpu" else None
            if found is not None:
                seg = found[0]
                if id(seg) not in seen:
                    seen.add(id(seg))
                    entries.append(_Saved(seg, seg.size, t.device))
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.data_ptr() in seen:
                continue
            if not storage.resizable():
                raise ValueError(
                    f"release_memory({tag!r}): a tensor of shape {tuple(t.shape)} lives in memory "
                    "this process does not own (not resizable), so it cannot be freed"
                )
            seen.add(storage.data_ptr())
            entries.append(_Saved(storage, nbytes, t.device))
        freed = 0
        for e in entries:
            if isinstance(e.obj, SharedSegment):
                if keep:
                    e.path = os.path.join(self._dir(), f"{tag}_{next(self._counter)}.bin")
                    _write_all(e.path, _host_view(e.obj.tensor), self.drop_cache)
                e.obj.punch()
            else:
                data = _bytes_of(e.obj, e.nbytes, e.device)
                if keep and e.device.type == "cuda":
                    e.host = torch.empty(e.nbytes, dtype=torch.uint8, pin_memory=True)
                    e.host.copy_(data)
                elif keep:
                    e.path = os.path.join(self._dir(), f"{tag}_{next(self._counter)}.bin")
                    _write_all(e.path, _host_view(data), self.drop_cache)
                del data
                e.obj.resize_(0)
            freed += e.nbytes
        if any(e.device.type == "cuda" for e in entries):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self._saved[tag] = entries
        return freed

    def resume(self, tag: str) -> int:
        """Reallocate and restore what `release` freed under ``tag``; returns the bytes restored.
        An unreleased tag raises ValueError."""
        entries = self._saved.pop(tag, None)
        if entries is None:
            raise ValueError(f"resume_memory: tag {tag!r} is not released")
        restored = 0
        for e in entries:
            if isinstance(e.obj, SharedSegment):
                if e.path is not None:
                    _read_all(e.path, _host_view(e.obj.tensor))
            else:
                e.obj.resize_(e.nbytes)
                data = _bytes_of(e.obj, e.nbytes, e.device)
                if e.host is not None:
                    data.copy_(e.host)
                    torch.cuda.synchronize(e.device)
                elif e.path is not None:
                    _read_all(e.path, _host_view(data))
            if e.path is not None:
                _unlink_quietly(e.path)
            e.host = None
            restored += e.nbytes
        return restored

    def close(self) -> None:
        """Remove the temporary directory (released data is lost)."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class MemoryTags:
    """The bookkeeping of ``release_memory`` / ``resume_memory``: tags with a hook (an engine's
    (release, resume) callables, e.g. "kv_cache") call it; other tags free the storages their
    owner names through an `OffloadStore`. Releasing a released tag is skipped, not an error."""

    def __init__(self, store: OffloadStore,
                 hooks: Mapping[str, tuple[Callable[[], Any], Callable[[], Any]]] | None = None) -> None:
        self.store, self.hooks = store, dict(hooks or {})
        self._hooked: set[str] = set()

    @property
    def released(self) -> set[str]:
        """Tags currently released."""
        return self.store.released_tags | self._hooked

    def release(self, tags: Iterable[str],
                tensors_of: Callable[[str], tuple[list[torch.Tensor], bool]]) -> dict[str, Any]:
        """Release ``tags``; ``tensors_of(tag)`` gives (tensors to free, keep contents?) for
        tags without a hook. Returns {"released", "skipped", "rss_before", "rss_after"}."""
        out: dict[str, Any] = {"released": {}, "skipped": [], "rss_before": rss_bytes()}
        for tag in tags:
            if tag in self.released:
                out["skipped"].append(tag)
            elif tag in self.hooks:
                self.hooks[tag][0]()
                self._hooked.add(tag)
                out["released"][tag] = None
            else:
                tensors, keep = tensors_of(tag)
                out["released"][tag] = self.store.release(tag, tensors, keep=keep)
        out["rss_after"] = rss_bytes()
        return out

    def resume(self, tags: Iterable[str] | None, after: Callable[[str], None]) -> dict[str, Any]:
        """Resume ``tags`` (default every released one; unreleased ones are ignored), calling
        ``after(tag)`` for each restored storage tag. Returns {"resumed", "rss_after"}."""
        out: dict[str, Any] = {"resumed": {}}
        for tag in sorted(self.released) if tags is None else list(tags):
            if tag in self._hooked:
                self.hooks[tag][1]()
                self._hooked.discard(tag)
                out["resumed"][tag] = None
            elif tag in self.store.released_tags:
                out["resumed"][tag] = self.store.resume(tag)
                after(tag)
        out["rss_after"] = rss_bytes()
        return out


__all__ = ["HANDLES_FORMAT", "ColocateError", "ColocateReceiver", "ColocateSender", "OffloadStore",
           "SharedSegment", "build_handles", "create_segment", "done_key", "find_segment", "open_segment",
           "pid_alive", "plan_boxes", "reap_orphans", "rss_bytes", "share_tensors", "weights_key"]
