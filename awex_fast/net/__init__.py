"""HTTP: the KV store every join meets through (`kvstore`: the store and its errors;
`kv_server`: routes, server, CLI; `kv_client`: clients), and the aiohttp helpers all servers
share (`httputil`: auth, JSON errors and bodies, retries with backoff, event-loop threads;
`serving`: serving an app, in a loop or a background thread, behind the connection limits of
`conn_guard`; `server_args`: the limit options every server command takes).

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
    "KVStoreServer": "kv_server",
    "add_kv_routes": "kv_server",
    "kv_server_main": "kv_server",
    "AsyncKVStoreClient": "kv_client",
    "KVStoreClient": "kv_client",
    "json_error": "httputil",
    "json_error_middleware": "httputil",
    "auth_headers": "httputil",
    "check_bearer": "httputil",
    "read_json_body": "httputil",
    "RetriesExhausted": "httputil",
    "backoff_delay": "httputil",
    "error_message": "httputil",
    "request_with_retries": "httputil",
    "EventLoopThread": "httputil",
    "ServeLimits": "conn_guard",
    "serve_app": "serving",
    "ServedApp": "serving",
    "BackgroundServer": "serving",
    "serve_until_signal": "serving",
    "ServerSettings": "server_args",
    "add_server_arguments": "server_args",
    "server_settings": "server_args",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
