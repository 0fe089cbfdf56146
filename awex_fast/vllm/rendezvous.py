"""How the trainer ranks and vLLM's workers meet, with no controller but trainer rank 0.

vLLM's weight-transfer API gives the trainer one channel to the workers: four RPCs driven by
trainer rank 0. Everything else goes through an awex_fast KV store (hosted by trainer rank 0
unless the user runs one), with the keys of the adapters' protocol (`awex_fast.sync.protocol`) and
the steps of the one join (`awex_fast.sync.join`):

0. every vLLM engine (one server, all its workers) claims a place (`claim_engine`): trainer rank
   0 asks every client to claim (an init RPC with ``claim`` set), and a client may stand for
   several servers (vLLM's Ray client over several actors, a client over several URLs), so the
   engines number themselves; trainer rank 0 orders the claims (`order_engines`) and every
   worker reads its engine index from ``vllm_engine_order``;
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

Values are the join's `encode_side_metas` JSON (base64 metas inside), never pickle. A value
that never comes raises `awex_fast.sync.JoinTimeoutError` (a `TimeoutError`) naming the step,
the pair, the KV store and who did not publish.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from awex_fast.meta import MetadataError, ParameterMeta, merge_metas
from awex_fast.net import KVKeyError, KVStoreClient, KVTimeoutError
from awex_fast.sync import (
    decode_side_metas,
    encode_side_metas,
    gather_rank_metas,
    publish_side,
    wait_side,
    wait_value,
)

__all__ = [
    "ENGINES_SET",
    "ENGINE_ORDER_KEY",
    "NEXT_ROUND_KEY",
    "EngineClaim",
    "WorkerInitError",
    "announce_round",
    "announced_round",
    "claim_engine",
    "claim_failed",
    "collect_inference",
    "collect_training",
    "engine_errors",
    "engine_index",
    "engine_sizes",
    "fp8_targets",
    "order_engines",
    "publish_fp8_targets",
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


ENGINES_SET = "vllm_engines"  # members "<client index, 6 digits>-<engine token>"
ENGINE_ORDER_KEY = "vllm_engine_order"  # [token, ...]: engine e is the e-th


@dataclass(frozen=True)
class EngineClaim:
    """One vLLM engine that answered the claim: behind which client, its token, its size, its
    data-parallel replica in its server, and where its first worker runs (for error messages)."""

    client: int
    token: str
    size: int
    host: str
    pid: int
    replica: int = 0

    def name(self, client: str, alone: bool) -> str:
        """How errors name this engine: its client's name, and where that client stands for
        several engines (replicas, servers), which one."""
        if alone:
            return client
        return f"{client} (data-parallel replica {self.replica}, worker 0 pid {self.pid} on {self.host})"


def claim_engine(kv: KVStoreClient, pair: str, client: int, token: str, size: int, replica: int = 0) -> None:
    """Step 0 (worker 0 of an engine): claim a place for this engine behind client ``client``."""
    kv.put(pair, f"vllm_claim_{token}", {"client": int(client), "size": int(size), "replica": int(replica),
                                         "host": socket.gethostname(), "pid": os.getpid()})
    kv.add_to_set(pair, ENGINES_SET, f"{int(client):06d}-{token}")


def claim_failed(kv: KVStoreClient, pair: str, client: int, who: str, error: BaseException) -> None:
    """Step 0, where a worker could not claim its engine's place: say so, so that the trainer
    refuses the join instead of updating the other engines and labelling a server one of whose
    replicas never joined (it would serve the old weights under the new label)."""
    token = f"failed{os.getpid()}"
    kv.put(pair, f"vllm_claim_{token}", {"failed": f"{who}: {type(error).__name__}: {error}"})
    kv.add_to_set(pair, ENGINES_SET, f"{int(client):06d}-{token}")


def order_engines(kv: KVStoreClient, pair: str, clients: Sequence[str]) -> list[EngineClaim]:
    """Step 0 (trainer rank 0, after every client's claim RPC returned): the engines in order
    (by client, replica, then token), published as ``vllm_engine_order``. A client behind which no
    engine claimed a place raises `WorkerInitError` naming it."""
    claims = []
    for member in kv.set_members(pair, ENGINES_SET):
        client, _, token = member.partition("-")
        value = kv.get(pair, f"vllm_claim_{token}")
        if "failed" in value:
            raise WorkerInitError(f"a vLLM engine behind {clients[int(client)]} could not claim its place, "
                                  f"so it would not receive the round: {value['failed']}")
        claims.append(EngineClaim(int(client), token, int(value["size"]), str(value["host"]),
                                  int(value["pid"]), int(value.get("replica", 0))))
    claims.sort(key=lambda e: (e.client, e.replica, e.token))
    silent = [name for c, name in enumerate(clients) if not any(e.client == c for e in claims)]
    if silent:
        raise WorkerInitError(f"no vLLM engine behind {', '.join(silent)} answered awex_fast's claim: "
                              "is the server's --weight-transfer-config backend awex_fast?")
    kv.put(pair, ENGINE_ORDER_KEY, [e.token for e in claims])
    return claims


def engine_index(kv: KVStoreClient, pair: str, token: str, timeout_s: float) -> tuple[int, int]:
    """Step 0 (every worker): (this engine's index, the number of engines)."""
    order = wait_value(kv, pair, ENGINE_ORDER_KEY, timeout_s, step="learn the engine order",
                       who="trainer rank 0", rank=0)
    if token not in order:
        raise WorkerInitError(f"this engine (token {token}) is not in the engine order {order}: its claim "
                              "came after trainer rank 0 counted the engines")
    return order.index(token), len(order)


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


def _one_group(value: object, side: str, who: str) -> tuple[int, list[ParameterMeta]]:
    """(size, metas) of a one-group side value that ``who`` published; `MetadataError` naming it."""
    try:
        sizes, groups = decode_side_metas(value, side)
    except MetadataError as exc:
        raise MetadataError(f"{who}: {exc}") from None
    return sizes[0], groups[0]


def collect_training(kv: KVStoreClient, pair: str, world_size: int, timeout_s: float,
                     bucket_bytes: int) -> list[ParameterMeta]:
    """Step 2 (trainer rank 0): merge every training rank's pieces, publish
    ``training_params_meta`` with the bucket size every rank plans with; returns the merge."""
    groups = gather_rank_metas(kv, pair, [train_rank_key(r) for r in range(world_size)], timeout_s,
                               step="collect training metadata", who="training rank",
                               decode=lambda value, what: _one_group(value, "training", what)[1])
    merged = merge_metas(groups)
    publish_side(kv, pair, "training", [merged], [world_size], bucket_bytes=bucket_bytes)
    return merged


def training_metas(kv: KVStoreClient, pair: str, timeout_s: float) -> list[ParameterMeta]:
    """Step 3 (a worker): the merged training metadata (side-local training ranks)."""
    return wait_side(kv, pair, "training", timeout_s, who="trainer rank 0")[1][0]


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
    value = wait_value(kv, pair, worker_key(engine, rank), max(0.0, deadline - time.monotonic()),
                       step="collect inference metadata", who=who, rank=rank)
    if isinstance(value, dict) and "error" in value:
        raise WorkerInitError(f"{who} failed to join: {value['error']}")
    return _one_group(value, "inference", who)


def collect_inference(kv: KVStoreClient, pair: str, engines: Sequence[str], timeout_s: float,
                      check: Callable[[list[int]], None] | None = None) -> list[int]:
    """Step 4 (trainer rank 0): merge each engine's workers' pieces (``engines`` names them, in
    order, for error messages), publish ``infer_params_meta``; returns the engine sizes.
    ``check`` may refuse the sizes (raise) before anything is published."""
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
    if check is not None:
        check(sizes)
    publish_side(kv, pair, "inference", groups, sizes)
    return sizes


def engine_sizes(kv: KVStoreClient, pair: str, timeout_s: float) -> list[int]:
    """Step 5: the engine sizes published in ``infer_params_meta`` (waits for it)."""
    return wait_side(kv, pair, "inference", timeout_s, who="trainer rank 0 (infer_params_meta)")[0]


NEXT_ROUND_KEY = "vllm_next_round"


def announce_round(kv: KVStoreClient, pair: str, rnd: int) -> None:
    """Trainer rank 0, before ``start_weight_update``: the round the workers are to receive while
    vLLM serves (vLLM's start RPC carries no arguments)."""
    kv.put(pair, NEXT_ROUND_KEY, {"round": int(rnd)})


def announced_round(kv: KVStoreClient, pair: str, timeout_s: float) -> int:
    """A worker, in ``start_weight_update``: the round trainer rank 0 announced."""
    value = kv.wait(pair, NEXT_ROUND_KEY, timeout_s)
    rnd = value.get("round") if isinstance(value, dict) else None
    if isinstance(rnd, bool) or not isinstance(rnd, int):
        raise MetadataError(f"{NEXT_ROUND_KEY} in pair {pair!r} holds {value!r}, not a round number")
    return rnd


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


def _fp8_key(engine: int) -> str:
    return f"vllm_fp8_targets_e{int(engine)}"


def publish_fp8_targets(kv: KVStoreClient, pair: str, engine: int, targets: dict[str, Sequence[int]]) -> None:
    """Worker 0 of an engine, after its layout: the checkpoint weights its model holds in block
    FP8 and their block size (`awex_fast.vllm.fp8_layout`)."""
    kv.put(pair, _fp8_key(engine), {name: [int(b) for b in block] for name, block in targets.items()})


def fp8_targets(kv: KVStoreClient, pair: str, engines: int) -> dict[str, tuple[int, int]]:
    """Every trainer rank, after a join: the block-FP8 weights of all engines (name -> block). Two
    engines that quantize one name with different blocks are refused: one trainer-side scale
    cannot serve both."""
    out: dict[str, tuple[int, int]] = {}
    for e in range(engines):
        try:
            value = kv.get(pair, _fp8_key(e))
        except KVKeyError:
            continue
        for name, block in value.items():
            block = (int(block[0]), int(block[1]))
            if out.setdefault(name, block) != block:
                raise WorkerInitError(f"vLLM engines quantize {name!r} with blocks {out[name]} and {block}; "
                                      "give them one FP8 format, or fp8_quantize='engine'")
    return out
