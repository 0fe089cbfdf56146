"""Rank 0's calls to vLLM through its weight-sync clients, and how their failures read: every
error names the server (its client) and the call that failed, with vLLM's own HTTP error body
where there is one."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

from awex_fast.net import KVStoreClient
from awex_fast.transport import TransferError
from awex_fast.vllm import rendezvous

__all__ = [
    "SendError",
    "call_all",
    "client_name",
    "clients_of",
    "collect_or_fail",
    "numeric_label",
    "raise_worker_errors",
    "result",
]


class SendError(TransferError):
    """A round of `send_weights` failed; the message names the vLLM worker or trainer rank."""


def clients_of(client: Any) -> list[VLLMWeightSyncClient]:
    out = list(client) if isinstance(client, (list, tuple)) else [client]
    for c in out:
        if not isinstance(c, VLLMWeightSyncClient):
            raise TypeError(f"client {c!r} lacks the VLLMWeightSyncClient methods")
    return out


def client_name(client: Any) -> str:
    return str(getattr(client, "base_url", None) or type(client).__name__)


def raise_worker_errors(kv: KVStoreClient, pair: str, sizes: list[int], engines: list[str], what: str,
                         timeout: float) -> None:
    errors = rendezvous.worker_errors(kv, pair, sizes, engines, what, timeout)
    if errors:
        raise rendezvous.WorkerInitError("; ".join(errors))


def result(fut: Future, where: str, what: str, timeout: float) -> Any:
    try:
        return fut.result(timeout=timeout)
    except TimeoutError:
        raise SendError(f"vLLM at {where}: {what} did not answer within {timeout:.0f} s") from None
    except BaseException as exc:
        detail = http_detail(exc)
        raise SendError(f"vLLM at {where}: {what} failed: {detail}") from exc


def http_detail(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    text = getattr(response, "text", None)
    if text:
        try:
            body = json.loads(text)
            text = body.get("error", body) if isinstance(body, dict) else body
        except ValueError:
            pass
        return f"{exc} ({str(text)[:2000]})"
    return f"{type(exc).__name__}: {exc}"


def call_all(pool: ThreadPoolExecutor, clients: list, what: str, call: Callable[[Any], Any],
             timeout: float) -> list[str | None]:
    """``call`` on every client at once; per client, its error (naming the server) or None."""
    futures = [(client_name(c), pool.submit(call, c)) for c in clients]
    errors: list[str | None] = []
    for where, fut in futures:
        try:
            result(fut, where, what, timeout)
            errors.append(None)
        except SendError as exc:
            errors.append(str(exc))
    return errors


def collect_or_fail(kv: KVStoreClient, pair: str, engines: list[str], inits: list[tuple[str, Future]],
                     timeout: float, check: Callable[[list[int]], None]) -> list[int]:
    """Rank 0: merge the workers' metadata; if a worker's init RPC fails first (an unknown
    backend, a bad request), raise that instead of waiting out the timeout."""
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def collect() -> None:
        try:
            outcome["sizes"] = rendezvous.collect_inference(kv, pair, engines, timeout, check)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = exc
        done.set()

    threading.Thread(target=collect, daemon=True, name="awex-collect").start()
    while not done.wait(0.2):
        for where, fut in inits:
            if fut.done() and fut.exception() is not None:
                result(fut, where, "init_weight_transfer_engine", timeout)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["sizes"]


def numeric_label(label: object) -> int | None:
    """``label`` as a non-negative integer ("7" -> 7), or None when it is not one."""
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label if label >= 0 else None
    text = str(label).strip() if label is not None else ""
    return int(text) if text.isdigit() else None
