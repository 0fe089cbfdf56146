"""Dtype names and element sizes without torch: `dtype_name` canonicalises a ``torch.dtype`` or
an alias to the name the metadata carries, `dtype_itemsize` gives its bytes per element."""

from __future__ import annotations

from typing import Any

from awex_fast.meta.errors import MetadataError

# Element sizes of every dtype torch 2.11-2.13 names (``torch.<name>.itemsize``), so that the
# metadata layer never imports torch. The test compares this table with torch.
_DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "bits8": 1,
    "bits16": 2,
    **{f"int{b}": 1 for b in range(1, 8)},
    **{f"uint{b}": 1 for b in range(1, 8)},
}
_DTYPE_ALIASES = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "short": "int16",
    "int": "int32",
    "long": "int64",
    "chalf": "complex32",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "bit": "uint1",
}


def dtype_name(dtype: Any) -> str:
    """Canonical dtype string for a ``torch.dtype`` or a name: ``torch.half`` -> ``"float16"``."""
    if type(dtype) is str and dtype in _DTYPE_ITEMSIZE:
        return dtype
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def dtype_itemsize(name: Any) -> int:
    """Bytes per element of a dtype name (or ``torch.dtype``), as torch reports ``itemsize``;
    raises `MetadataError` for a name torch does not know."""
    canon = dtype_name(name)
    try:
        return _DTYPE_ITEMSIZE[canon]
    except KeyError:
        raise MetadataError(f"unknown dtype {canon!r}") from None
