"""Lazy public names for a package (PEP 562), shared by every ``__init__`` of awex_fast.

A package lists ``{public name: defining submodule}``; a submodule is imported on first use of one
of its names, so ``import awex_fast`` is cheap and tools that need only metadata or the KV store
never load torch or the native core. It also keeps package imports free of import-order cycles:
no ``__init__`` imports a sibling module eagerly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], module_globals: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return the ``__getattr__`` and ``__dir__`` of ``package``.

    ``exports`` maps a public name to the module that defines it: a full dotted path, or a
    submodule name relative to ``package``. ``__getattr__`` also resolves a submodule of the
    package by name (``awex_fast.transfer.wire`` after ``import awex_fast.transfer``).
    """

    def absolute(module: str) -> str:
        return module if "." in module else f"{package}.{module}"

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            if name.startswith("__"):
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(absolute(module)), name)
        module_globals[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(module_globals) | set(exports))

    return __getattr__, __dir__
