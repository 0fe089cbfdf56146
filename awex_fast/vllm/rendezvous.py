"""How the trainer ranks and vLLM's workers meet, with no controller but trainer rank 0.

vLLM's weight-transfer API gives the trainer one channel to the workers: four RPCs driven by
trainer rank 0. Everything else goes through an awex_fast KV store (hosted by trainer rank 0
unless the user runs one), with the keys of the adapters' protocol (`awex_fast.sync.adapters`):

1. every trainer rank publishes its pieces under `train_rank_key` (side-local ranks);
2. trainer rank 0 merges them into ``training_params_meta`` (`collect_training`);
3. every worker reads ``training_params_meta`` (the checkpoint names, shapes and dtypes it will
   receive), learns its layout from vLLM's loaders, and publishes its pieces, or the error that
   stopped it, under `worker_key`;
4. trainer rank 0 merges the workers' pieces, engine by engine, into ``infer_params_meta``
   (`collect_inference`); a worker's error is raised here at once, naming the worker;
5. every rank calls its adapter's ``init_weight_update_group`` with the sizes both values give;
6. each worker reports how its join, and later each round, ended under `worker_status_key`, and
   its RPC returns normally either way: vLLM 0.32's multiprocess executor stops reading replies at
   the first worker that raises, so the other workers' replies answer the *next* RPC, and the
   server is wedged. Trainer rank 0 reads the outcomes (`worker_errors`) and raises.

Values are the adapters' `encode_side_metas` JSON (base64 metas inside), never pickle.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from awex_fast.meta import ParameterMeta, merge_metas
from awex_fast.net import KVStoreClient, KVTimeoutError
from awex_fast.sync import (
    INFER_META_KEY,
    TRAINING_META_KEY,
    decode_side_metas,
    encode_side_metas,
)

__all__ = [
    "WorkerInitError",
    "collect_inference",
    "collect_training",
    "engine_errors",
    "engine_sizes",
    "publish_training_rank",
    "publish_worker",
    "publish_worker_error",
    "train_rank_key",
    "training_metas",
    "worker_errors",
    "worker_key",
    "worker_status_key",
]


class WorkerInitError(RuntimeError):
    """A vLLM worker could not join: its layout, its metadata or its transfer group failed."""


def train_rank_key(rank: int) -> str:
    """KV key of training rank ``rank``'s own pieces."""
    return f"vllm_train_rank{int(rank)}_meta"


def worker_key(engine: int, rank: int) -> str:
    """KV key of the pieces (or the error) of worker ``rank`` of engine ``engine``."""
    return f"vllm_engine{int(engine)}_rank{int(rank)}_meta"


def publish_training_rank(kv: KVStoreClient, pair: str, rank: int, world_size: int,
                          metas: Sequence[ParameterMeta]) -> None:
    """Step 1: this training rank's pieces."""
    kv.put(pair, train_rank_key(rank), encode_side_metas("training", [metas], [world_size]))


def _wait(kv: KVStoreClient, pair: str, key: str, timeout_s: float, who: str) -> dict:
    try:
        return kv.wait(pair, key, timeout_s)
    except KVTimeoutError:
        raise TimeoutError(f"{who} did not publish its metadata (KV key {key!r} of pair {pair!r}) "
                           f"within {timeout_s:.0f} s") from None


def collect_training(kv: KVStoreClient, pair: str, world_size: int, timeout_s: float,
                     bucket_bytes: int) -> list[ParameterMeta]:
    """Step 2 (trainer rank 0): merge every training rank's pieces, publish
    ``training_params_meta`` with the bucket size every rank plans with; returns the merge."""
    deadline = time.monotonic() + timeout_s
    groups = []
    for r in range(world_size):
        left = max(0.0, deadline - time.monotonic())
        value = _wait(kv, pair, train_rank_key(r), left, f"training rank {r}")
        groups.append(decode_side_metas(value, "training")[1][0])
    merged = merge_metas(groups)
    kv.put(pair, TRAINING_META_KEY, encode_side_metas("training", [merged], [world_size],
                                                      bucket_bytes=bucket_bytes))
    return merged


def training_metas(kv: KVStoreClient, pair: str, timeout_s: float) -> list[ParameterMeta]:
    """Step 3 (a worker): the merged training metadata (side-local training ranks)."""
    value = _wait(kv, pair, TRAINING_META_KEY, timeout_s, "trainer rank 0")
    return decode_side_metas(value, "training")[1][0]


def publish_worker(kv: KVStoreClient, pair: str, engine: int, rank: int, engine_size: int,
                   metas: Sequence[ParameterMeta]) -> None:
    """Step 3 (a worker): its pieces in engine-local ranks."""
    kv.put(pair, worker_key(engine, rank), encode_side_metas("inference", [metas], [engine_size]))


def publish_worker_error(kv: KVStoreClient, pair: str, engine: int, rank: int, error: BaseException) -> None:
    """Step 3, failed: what stopped the worker, so trainer rank 0 raises it instead of waiting."""
    kv.put(pair, worker_key(engine, rank), {"error": f"{type(error).__name__}: {error}"})


def _worker_value(kv: KVStoreClient, pair: str, engine: int, rank: int, deadline: float,
                  where: str) -> tuple[int, list[ParameterMeta]]:
    who = f"vLLM engine {engine} ({where}) worker {rank}"
    value = _wait(kv, pair, worker_key(engine, rank), max(0.0, deadline - time.monotonic()), who)
    if isinstance(value, dict) and "error" in value:
        raise WorkerInitError(f"{who} failed to join: {value['error']}")
    sizes, groups = decode_side_metas(value, "inference")
    return sizes[0], groups[0]


def collect_inference(kv: KVStoreClient, pair: str, engines: Sequence[str], timeout_s: float) -> list[int]:
    """Step 4 (trainer rank 0): merge each engine's workers' pieces (``engines`` names them, in
    order, for error messages), publish ``infer_params_meta``; returns the engine sizes."""
    deadline = time.monotonic() + timeout_s
    sizes, groups = [], []
    for e, where in enumerate(engines):
        size, first = _worker_value(kv, pair, e, 0, deadline, where)
        metas = [first]
        for r in range(1, size):
            other_size, m = _worker_value(kv, pair, e, r, deadline, where)
            if other_size != size:
                raise WorkerInitError(f"vLLM engine {e} ({where}): worker 0 reports {size} workers, "
                                      f"worker {r} reports {other_size}")
            metas.append(m)
        sizes.append(size)
        groups.append(merge_metas(metas))
    kv.put(pair, INFER_META_KEY, encode_side_metas("inference", groups, sizes))
    return sizes


def engine_sizes(kv: KVStoreClient, pair: str, timeout_s: float) -> list[int]:
    """Step 5: the engine sizes published in ``infer_params_meta`` (waits for it)."""
    value = _wait(kv, pair, INFER_META_KEY, timeout_s, "trainer rank 0 (infer_params_meta)")
    return decode_side_metas(value, "inference")[0]


def worker_status_key(engine: int, rank: int, what: str) -> str:
    """KV key where worker ``rank`` of engine ``engine`` reports how ``what`` ("joined",
    "round<v>") ended."""
    return f"vllm_engine{int(engine)}_rank{int(rank)}_{what}"


def publish_worker_status(kv: KVStoreClient, pair: str, engine: int, rank: int, what: str,
                          error: BaseException | str | None = None) -> None:
    """Step 6 (a worker): ``what`` succeeded (``error`` None) or failed with ``error``."""
    value = {"ok": True} if error is None else {"ok": False, "error": str(error)}
    kv.put(pair, worker_status_key(engine, rank, what), value)


def engine_errors(kv: KVStoreClient, pair: str, sizes: Sequence[int], engines: Sequence[str], what: str,
                  timeout_s: float) -> list[list[str]]:
    """Step 6 (trainer rank 0): per engine, one message per worker whose ``what`` failed or
    that did not report within ``timeout_s``, naming the engine and the worker (an empty list
    for an engine whose workers all succeeded)."""
    deadline = time.monotonic() + timeout_s
    out: list[list[str]] = []
    for e, (size, where) in enumerate(zip(sizes, engines, strict=True)):
        errors: list[str] = []
        for r in range(size):
            key = worker_status_key(e, r, what)
            try:
                value = kv.wait(pair, key, max(0.0, deadline - time.monotonic()))
            except KVTimeoutError:
                errors.append(f"vLLM engine {e} ({where}) worker {r}: no report of {what} "
                              f"within {timeout_s:.0f} s")
                continue
            if not (isinstance(value, dict) and value.get("ok") is True):
                detail = value.get("error") if isinstance(value, dict) else value
                errors.append(f"vLLM engine {e} ({where}) worker {r}: {what} failed: {detail}")
        out.append(errors)
    return out


def worker_errors(kv: KVStoreClient, pair: str, sizes: Sequence[int], engines: Sequence[str], what: str,
                  timeout_s: float) -> list[str]:
    """`engine_errors`, all engines' messages in one list (empty when every worker succeeded)."""
    return [m for errors in engine_errors(kv, pair, sizes, engines, what, timeout_s) for m in errors]
