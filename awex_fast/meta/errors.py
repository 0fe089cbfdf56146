"""`MetadataError` and the small helpers every metadata module uses to build its messages
(`_short`, `_fmt_box`), to read integer tuples (`_int_tuple`) and to build many small objects
quickly (`_gc_paused`)."""

from __future__ import annotations

import contextlib
import gc
import operator
from collections.abc import Iterable, Iterator, Sequence


class MetadataError(ValueError):
    """Malformed, inconsistent or overlapping shard metadata."""


def _int_tuple(values: Iterable[int], what: str, name: str | None = None) -> tuple[int, ...]:
    # operator.index accepts int, numpy and 0-d integer tensors, and refuses floats and strings
    # (int() would silently truncate 1.5 to 1).
    try:
        out = tuple(map(operator.index, values))
    except TypeError as exc:
        where = "" if name is None else f"parameter {name!r}: "
        raise MetadataError(f"{where}{what} must be a sequence of integers, got {_short(values)}") from exc
    return out


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building many small acyclic objects (metadata for 70k tensors):
    collections triggered by allocation counts otherwise make decoding ~5x slower."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt_box(offset: Sequence[int], shape: Sequence[int]) -> str:
    """``[0:4, 8:16]``: the box as slices (``[]`` for a 0-d scalar)."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offset, shape, strict=True)) + "]"
