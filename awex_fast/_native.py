"""Loads the native core, awex_fast._C, with an error that says how to get it."""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def native() -> ModuleType:
    """The compiled extension module (raises ImportError with build instructions if missing)."""
    try:
        from awex_fast import _C
    except ImportError as exc:
        raise ImportError(
            "awex_fast's native core (awex_fast._C) is not built: install with `pip install .` "
            "or, in a source checkout, run scripts/dev_build.sh"
        ) from exc
    return _C


def build_info() -> dict:
    """How the native core was built: version, cuda (bool), cuda_version, cuda_archs, compiler,
    threads (the CPU copy pool's size)."""
    return dict(native().build_info())
