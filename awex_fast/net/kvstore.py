"""The in-memory key-value store behind the HTTP KV store, and the errors of its clients.

Why a KV store at all: the training and inference sides of a weight-sync pair run in different
jobs and must exchange metadata (``training_params_meta``, ``infer_params_meta``, plan digests,
colocated handles and acks; key names in docs/DESIGN.md, "KV keys") before any transfer group
exists. This module holds the data and the error types; `awex_fast.net.kv_server` serves it over
HTTP (routes and answers as AReaL's weight-update gateway serves them) and
`awex_fast.net.kv_client` talks to any server with those routes.

Values are any JSON, kept as their JSON encoding; sets hold strings; both are scoped by pair
name and live in separate namespaces. The store is bounded (``max_keys``, ``max_total_bytes``):
a write past either cap raises `KVStoreFull`, which the server answers 413 naming the cap.
Nothing is ever pickled: values are JSON in, JSON out.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

__all__ = [
    "ADMIN_KEY_ENV",
    "KVAuthError",
    "KVKeyError",
    "KVRequestError",
    "KVStore",
    "KVStoreError",
    "KVStoreFull",
    "KVTimeoutError",
    "KVUnavailableError",
    "resolve_admin_key",
]

ADMIN_KEY_ENV = "AWEX_FAST_ADMIN_KEY"
DEFAULT_MAX_KEYS = 100_000  # values and sets together, over every pair
DEFAULT_MAX_TOTAL_BYTES = 4 << 30  # encoded values, set members and key names together


class KVStoreFull(Exception):
    """A write would take the store past its key-count or total-byte cap (HTTP 413).
    ``limit`` names the cap (``"max_keys"`` or ``"max_total_bytes"``), ``limit_value`` its value."""

    def __init__(self, message: str, *, limit: str, limit_value: int) -> None:
        """Record the message and which cap was hit."""
        super().__init__(message)
        self.limit = limit
        self.limit_value = limit_value


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class KVStoreError(Exception):
    """Base of every KV store client error. ``url``, ``status`` (HTTP code or None), ``pair``
    and ``key`` say which request failed; ``str()`` is the full message."""

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None,
                 pair: str | None = None, key: str | None = None) -> None:
        """Record the message and the request it belongs to."""
        super().__init__(message)
        self.message = message
        self.url = url
        self.status = status
        self.pair = pair
        self.key = key

    def __str__(self) -> str:
        """The message (overrides ``KeyError``'s quoting in :class:`KVKeyError`)."""
        return self.message


class KVKeyError(KVStoreError, KeyError):
    """The key is not in the store (HTTP 404). Also a ``KeyError``."""


class KVAuthError(KVStoreError):
    """The server refused the admin key: ``status`` 401 (missing) or 403 (wrong)."""


class KVRequestError(KVStoreError):
    """The server rejected the request itself (400 malformed, 413 too large, other 4xx)."""


class KVUnavailableError(KVStoreError, ConnectionError):
    """The server could not be reached, timed out, or answered 5xx after all retries.
    ``attempts`` counts the tries made."""

    def __init__(self, message: str, *, attempts: int, **kwargs: Any) -> None:
        """Record the message, the failed request and the number of attempts."""
        super().__init__(message, **kwargs)
        self.attempts = attempts


class KVTimeoutError(KVStoreError, TimeoutError):
    """``wait``/``wait_set_size`` gave up: the key (or set size) did not appear in time."""


# ---------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------


def json_bytes(value: Any, *, what: str) -> bytes:
    """Compact JSON encoding of ``value`` (no NaN/Infinity); ``TypeError`` naming ``what`` when
    it cannot be encoded."""
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serialisable: {exc}") from exc


def resolve_admin_key(admin_api_key: str | None) -> str | None:
    """``admin_api_key``, or ``$AWEX_FAST_ADMIN_KEY`` when it is None (``""`` stays ``""``)."""
    return os.environ.get(ADMIN_KEY_ENV) if admin_api_key is None else admin_api_key


class KVStore:
    """Thread-safe in-memory store: JSON values and string sets, both scoped by pair name.

    Values are kept as their JSON encoding, so a GET answers without re-encoding. Every method
    takes the lock; any number of threads (and the server's loop) may call concurrently.
    """

    def __init__(
        self, max_keys: int = DEFAULT_MAX_KEYS, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES
    ) -> None:
        """Create an empty store holding at most ``max_keys`` keys (values and sets) and
        ``max_total_bytes`` (encoded values plus the characters of names and members); a write past
        either raises `KVStoreFull`."""
        if max_keys < 1 or max_total_bytes < 1:
            raise ValueError(f"KVStore: max_keys ({max_keys}) and max_total_bytes ({max_total_bytes}) "
                             "must be positive")
        self.max_keys, self.max_total_bytes = int(max_keys), int(max_total_bytes)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str], bytes] = {}
        self._sets: dict[tuple[str, str], set[str]] = {}
        self._bytes = 0  # what the caps count; updated under the lock

    def _admit(self, new_key: bool, grow: int) -> None:
        """Raise `KVStoreFull` unless one more key (when ``new_key``) and ``grow`` bytes fit."""
        keys = len(self._values) + len(self._sets) + new_key
        if keys > self.max_keys:
            raise KVStoreFull(f"the store holds its limit of {self.max_keys} keys (max_keys)",
                              limit="max_keys", limit_value=self.max_keys)
        if self._bytes + grow > self.max_total_bytes:
            raise KVStoreFull(f"the store would hold {self._bytes + grow} bytes, over its limit of "
                              f"{self.max_total_bytes} bytes (max_total_bytes)",
                              limit="max_total_bytes", limit_value=self.max_total_bytes)

    def get_json(self, pair: str, key: str) -> bytes | None:
        """The JSON encoding of the value at ``pair/key``, or None when absent."""
        with self._lock:
            return self._values.get((pair, key))

    def put_json(self, pair: str, key: str, encoded: bytes) -> None:
        """Store an already JSON-encoded value (the caller vouches that it is valid JSON);
        `KVStoreFull` when it does not fit the caps."""
        with self._lock:
            old = self._values.get((pair, key))
            size = len(pair) + len(key) + len(encoded)
            grow = size - (0 if old is None else len(pair) + len(key) + len(old))
            self._admit(old is None, grow)
            self._values[(pair, key)] = encoded
            self._bytes += grow

    def get(self, pair: str, key: str) -> Any:
        """The value at ``pair/key``; ``KeyError`` naming the key when absent."""
        encoded = self.get_json(pair, key)
        if encoded is None:
            raise KeyError(f"key {key!r} not found in pair {pair!r}")
        return json.loads(encoded)

    def put(self, pair: str, key: str, value: Any) -> None:
        """Store any JSON-serialisable ``value`` (``TypeError`` otherwise)."""
        self.put_json(pair, key, json_bytes(value, what=f"value for key {key!r}"))

    def delete(self, pair: str, key: str) -> bool:
        """Remove the value at ``pair/key``; True if it existed. Sets are untouched."""
        with self._lock:
            old = self._values.pop((pair, key), None)
            if old is not None:
                self._bytes -= len(pair) + len(key) + len(old)
            return old is not None

    def add_to_set(self, pair: str, key: str, member: str) -> bool:
        """Add ``member`` to the set ``pair/key``; True if it was not there yet."""
        with self._lock:
            members = self._sets.get((pair, key))
            if members is not None and member in members:
                return False
            grow = len(member) + (0 if members is not None else len(pair) + len(key))
            self._admit(members is None, grow)
            self._sets.setdefault((pair, key), set()).add(member)
            self._bytes += grow
            return True

    def set_size(self, pair: str, key: str) -> int:
        """Number of members of the set ``pair/key`` (0 when it does not exist)."""
        with self._lock:
            return len(self._sets.get((pair, key), ()))

    def set_members(self, pair: str, key: str) -> list[str]:
        """The members of the set ``pair/key``, sorted (empty when it does not exist)."""
        with self._lock:
            return sorted(self._sets.get((pair, key), ()))

    def keys(self, pair: str) -> list[str]:
        """Sorted value keys of ``pair`` (sets not included)."""
        with self._lock:
            return sorted(k for p, k in self._values if p == pair)

    def clear_pair(self, pair: str) -> None:
        """Drop every value and set of ``pair`` (when a pair disconnects)."""
        with self._lock:
            for entry in [e for e in self._values if e[0] == pair]:
                self._bytes -= len(pair) + len(entry[1]) + len(self._values.pop(entry))
            for entry in [e for e in self._sets if e[0] == pair]:
                self._bytes -= len(pair) + len(entry[1]) + sum(map(len, self._sets.pop(entry)))
