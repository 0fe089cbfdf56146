"""`awex-fast bench --profile`: where one awex_fast sync spends each rank's CPU.

One extra, untimed sync runs under `cProfile`; every function's own time (``tottime``) is put
in one of a few buckets by what the function is, so the gap between awex_fast and the raw
transport is explained rather than guessed:

* ``copy``: the native pack / unpack / cast programs (`awex_fast._C` copy calls);
* ``native_runner``: the ipc transport's native replay of a whole update (pack, wait, unpack
  inside one C call);
* ``transport_wait``: waiting on sends and receives (torch.distributed work objects, ipc waits);
* ``transport_post``: posting sends and receives;
* ``checksum``: ``verify``'s native checksums;
* ``python``: everything else, the control code between native calls.

cProfile adds a little to every Python call, so ``python`` is an upper bound.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable

CATEGORIES = ("copy", "native_runner", "transport_wait", "transport_post", "checksum", "python")


def _category(file: str, name: str) -> str:
    """The bucket of one profiled function (``file``, ``name`` as `pstats` reports them)."""
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


def profile_call(fn: Callable[[], object]) -> dict[str, float]:
    """Run ``fn`` once under cProfile; seconds per category plus ``wall_s`` and ``cpu_s``."""
    prof = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    out = dict.fromkeys(CATEGORIES, 0.0)
    out["wall_s"] = time.perf_counter() - t0
    out["cpu_s"] = time.process_time() - c0
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    for (file, _, name), (_, _, tottime, _, _) in stats.items():
        out[_category(file, name)] += tottime
    return out


def top_functions(fn: Callable[[], object], n: int = 15) -> list[tuple[str, float]]:
    """The ``n`` functions with the most own time in one call of ``fn`` (for reading the buckets)."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(((f"{file}:{line}:{name}", v[2]) for (file, line, name), v in stats.items()),
                  key=lambda r: -r[1])
    return rows[:n]
