"""The disk weight-update hand-off, a file protocol both sides agree on (see `python_engines.api`):
the trainer writes a checkpoint into ``WeightUpdateMeta.path`` and then, last and atomically, the
marker `WEIGHT_VERSION_MARKER` holding ``{"version": v}``; the inference side waits for a marker
whose version is at least the one it expects and only then reads the weights."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["WEIGHT_VERSION_MARKER", "read_weight_version", "wait_for_weight_version", "write_weight_version"]

#: Name of the file, inside ``WeightUpdateMeta.path``, that announces a complete disk update.
WEIGHT_VERSION_MARKER = "awex_weight_version.json"


def write_weight_version(path: str | os.PathLike[str], version: int) -> Path:
    """Atomically write the marker announcing that ``path`` holds complete weights of ``version``.

    Writes a temporary file, fsyncs it and renames it over `WEIGHT_VERSION_MARKER`, so readers see
    either no marker, the previous one, or this one, never a partial file. Returns the marker path.
    """
    directory = Path(path)
    marker = directory / WEIGHT_VERSION_MARKER
    tmp = directory / f".{WEIGHT_VERSION_MARKER}.{os.getpid()}.tmp"
    payload = json.dumps({"version": int(version), "time": time.time()}).encode()
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)
    return marker


def read_weight_version(path: str | os.PathLike[str]) -> int | None:
    """The version announced by the marker in ``path``, or None when there is no marker."""
    marker = Path(path) / WEIGHT_VERSION_MARKER
    try:
        data = json.loads(marker.read_text())
    except FileNotFoundError:
        return None
    try:
        return int(data["version"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed weight version marker {marker}: {data!r}") from exc


def wait_for_weight_version(
    path: str | os.PathLike[str], version: int, timeout: float, poll_interval: float = 0.05
) -> int:
    """Block until ``path``'s marker announces a version >= ``version``; return that version.

    Raises TimeoutError naming the path, the expected and the last seen version.
    """
    deadline = time.monotonic() + timeout
    while True:
        seen = read_weight_version(path)
        if seen is not None and seen >= version:
            return seen
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"no weights of version >= {version} in {path} after {timeout:.1f} s (last seen: {seen})"
            )
        time.sleep(poll_interval)
