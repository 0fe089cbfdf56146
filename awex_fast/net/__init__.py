"""HTTP: the KV store (server and clients) every join meets through, and the aiohttp helpers
(auth, JSON errors, retries with backoff, background servers and event loops) all servers share.

Names resolve lazily (`awex_fast._lazy`): a submodule is imported on first use of one of its names.
"""

from __future__ import annotations

from awex_fast._lazy import lazy_exports

_EXPORTS = {
    "free_port": "ports",
    "ADMIN_KEY_ENV": "kvstore",
    "KVStore": "kvstore",
    "KVStoreFull": "kvstore",
    "KVStoreError": "kvstore",
    "KVKeyError": "kvstore",
    "KVAuthError": "kvstore",
    "KVRequestError": "kvstore",
    "KVUnavailableError": "kvstore",
    "KVTimeoutError": "kvstore",
    "KVStoreServer": "kvstore",
    "AsyncKVStoreClient": "kvstore",
    "KVStoreClient": "kvstore",
    "kv_server_main": "kvstore",
    "json_error": "httputil",
    "json_error_middleware": "httputil",
    "auth_headers": "httputil",
    "check_bearer": "httputil",
    "read_json_body": "httputil",
    "RetriesExhausted": "httputil",
    "backoff_delay": "httputil",
    "error_message": "httputil",
    "request_with_retries": "httputil",
    "serve_app": "httputil",
    "EventLoopThread": "httputil",
    "BackgroundServer": "httputil",
    "serve_until_signal": "httputil",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
