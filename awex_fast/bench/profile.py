"""`awex-fast bench --profile`: where one sync spends each rank's CPU.

One extra, untimed sync runs under `cProfile` with a thread-CPU timer, and every thread of the
rank's process is measured from the kernel's per-thread run time (``/proc/self/task/*/schedstat``,
nanoseconds), so the gap between awex_fast and the raw transport is explained rather than
guessed. Per rank, in CPU seconds:

* the main thread, split by what its functions are (each function's own CPU time):
  ``copy`` (the native pack / unpack / cast programs, `awex_fast._C` copy calls),
  ``native_runner`` (the ipc transport's native replay of a whole update: pack, wait, unpack
  inside one C call), ``transport_wait`` (waiting on sends and receives: torch.distributed work
  objects, ipc waits), ``transport_post`` (posting sends and receives, which on gloo may write
  the first bytes itself), ``checksum`` (``verify``'s native checksums) and ``python`` (the
  control code between native calls; cProfile adds a little to every Python call, so this is
  an upper bound);
* ``copy_threads``: the copy pool's helper threads (named ``awex_copy``), which take part in
  every pack, unpack and cast;
* ``transport_threads``: the transport's own threads (gloo's I/O loop and work threads, the
  TCP store), where gloo moves the bytes through the kernel;
* ``other_threads``: any other thread of the process;
* ``user_s`` / ``sys_s``: the process's user and kernel time (kernel time is mostly the socket
  copies of gloo), and ``cpu_s`` / ``wall_s``.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import resource
import time
from collections.abc import Callable
from pathlib import Path

MAIN_CATEGORIES = ("copy", "native_runner", "transport_wait", "transport_post", "checksum", "python")
THREAD_CATEGORIES = ("copy_threads", "transport_threads", "other_threads")
CATEGORIES = (*MAIN_CATEGORIES, *THREAD_CATEGORIES)
_TRANSPORT_THREADS = ("gloo", "pt_gloo", "pt_tcpstore", "pt_nccl")


def _category(file: str, name: str) -> str:
    """The bucket of one main-thread function (``file``, ``name`` as `pstats` reports them)."""
    if file != "~":  # Python code
        return "python"
    low = name.lower()  # a C function or method, e.g. "<built-in method awex_fast._C.copy.copy_boxes>"
    if "checksum" in low:
        return "checksum"
    if "awex_fast._c.shm.run" in low:
        return "native_runner"
    if "bell_wait" in low or "wait" in low or "synchronize" in low or "sleep" in low:
        return "transport_wait"
    if "awex_fast._c" in low:
        return "copy"
    if "_distributed_c10d" in low or "bell_ring" in low:
        return "transport_post"
    return "python"


def _thread_category(name: str) -> str:
    """The bucket of a helper thread, by the name the kernel knows it by."""
    if name == "awex_copy":
        return "copy_threads"
    if name.startswith(_TRANSPORT_THREADS):
        return "transport_threads"
    return "other_threads"


def thread_cpu_ns() -> dict[int, tuple[str, int]]:
    """Every thread of this process: tid -> (name, nanoseconds it has run). Empty where the
    kernel has no ``/proc/self/task`` (not Linux)."""
    out = {}
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return out
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ran = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        out[int(task.name)] = (name, ran)
    return out


def profile_call(fn: Callable[[], object]) -> dict[str, float]:
    """Run ``fn`` once under cProfile (thread-CPU timer) and measure every thread; CPU seconds
    per category (module docstring) plus ``user_s``, ``sys_s``, ``cpu_s`` and ``wall_s``."""
    prof = cProfile.Profile(time.thread_time)
    threads0, usage0 = thread_cpu_ns(), resource.getrusage(resource.RUSAGE_SELF)
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    out = dict.fromkeys(CATEGORIES, 0.0)
    out["wall_s"] = time.perf_counter() - t0
    out["cpu_s"] = time.process_time() - c0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["user_s"] = usage.ru_utime - usage0.ru_utime
    out["sys_s"] = usage.ru_stime - usage0.ru_stime
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    for (file, _, name), (_, _, tottime, _, _) in stats.items():
        out[_category(file, name)] += tottime
    main = os.getpid()  # the main thread's tid
    for tid, (name, ran) in thread_cpu_ns().items():
        if tid != main:
            out[_thread_category(name)] += (ran - threads0.get(tid, (name, 0))[1]) / 1e9
    return out


def top_functions(fn: Callable[[], object], n: int = 15) -> list[tuple[str, float]]:
    """The ``n`` main-thread functions with the most own CPU time in one call of ``fn``."""
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(((f"{file}:{line}:{name}", v[2]) for (file, line, name), v in stats.items()),
                  key=lambda r: -r[1])
    return rows[:n]
