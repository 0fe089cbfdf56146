"""POSIX shared-memory segments: the memory the ``ipc`` transport's doorbells and channels live
in, and the memory colocated mode shares training weights through (awex_fast.sync.colocate).

Why not ``multiprocessing.shared_memory``: on Linux shm_open(3) is a file under /dev/shm, and
segments are created and opened here with ``os.open`` + ``mmap`` because that module's resource
tracker (Python < 3.13) unlinks a segment when any process that merely *attached* to it exits.

A process killed before it unlinked its segments leaves them behind: segments made with
``owner_lock`` and named ``..._p<owner pid>_...`` can be found and removed by `reap_orphans`
once their owner is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch

SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE


class SegmentError(RuntimeError):
    """A shared segment could not be opened or mapped (gone, or smaller than its handle says)."""


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
            raise SegmentError(
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
            raise SegmentError(f"shared segment {name!r} holds {held} bytes, the handle says {self.size}")
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
        raise SegmentError(f"not a shared-memory handle: {dict(handle)}")
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


__all__ = ["SHM_DIR", "SegmentError", "SharedSegment", "create_segment", "find_segment", "open_segment",
           "pid_alive", "reap_orphans"]
