"""Memory release for ``release_memory`` / ``resume_memory``: free the memory behind tensors for
real and restore it bit-identically.

`OffloadStore` saves and frees storages per tag: CPU storages go to files in a temporary
directory (with the page cache dropped, or the "released" bytes would stay in RAM); shared
segments (awex_fast.transport.shm) have their pages punched out with MADV_REMOVE, which frees them
for every process mapping them; CUDA storages go to pinned host memory, then
``torch.cuda.empty_cache``. `MemoryTags` is the per-tag bookkeeping an adapter keeps on top of it
(engine hooks such as "kv_cache" next to storage tags).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from awex_fast.sync.colocate import ColocateError
from awex_fast.transport.shm import SharedSegment, find_segment

_PAGE = mmap.PAGESIZE


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc/self/statm), shared pages included."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE



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
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
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


__all__ = ["MemoryTags", "OffloadStore", "rss_bytes"]
