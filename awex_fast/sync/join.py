"""The join: how the two sides of a weight-sync pair meet through the KV store, written once and
used by every driver (`awex_fast.sync.pair.WeightSyncPair`, the adapters' own
``init_weight_update_group``, `python_engines`' train engine and remote inference client, and the
vLLM backend's `awex_fast.vllm.rendezvous`).

Why one module: each driver used to write the steps itself (publish this side's metas, wait for
the other side's, merge, assemble the world, exchange digests, form the transfer group), and
the copies drifted (one validated the metadata it decoded, another did not). The steps, in
order, each a small function here:

1. **report** - each worker's side-local metas, base64 metas JSON (`read_report`,
   `merge_per_engine`; per-rank KV values: `gather_rank_metas`);
2. **publish** - one side's merged value under ``training_params_meta`` / ``infer_params_meta``
   (`publish_side`, the value `encode_side_metas` writes), after `reset_group_keys` removed a
   stale ``transfer_master_port`` and stale digests;
3. **wait** - for the other side's value (`wait_side`: sizes and metas, validated);
4. **assemble** - both sides in transfer ranks (`World` for the sizes and every rank's
   ``init_weight_update_group`` arguments, `assemble_world` for the metas, `check_own_pieces`);
5. **digest** - every rank mirrors ``plan_digest_rank{r}`` (`publish_digest`), a controller
   compares them (`check_digests`);
6. **group** - the transfer group on the published port (`form_transfer_group`).

Every failure of a step names the step, the pair, the KV store's URL and, where known, the
missing or failing rank: `JoinError` (`JoinTimeoutError` for a value that never came; also a
`TimeoutError`). `run_step` turns any other exception of a step into one. Decoding errors stay
`MetadataError` naming their source. KV keys and values are exactly docs/DESIGN.md's ("KV
keys"), so peers built before this module still meet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from awex_fast.meta import (
    MetadataError,
    ParameterMeta,
    merge_metas,
    metas_from_b64,
    metas_to_b64,
    transfer_ranks,
    with_rank_offset,
)
from awex_fast.net import KVKeyError, KVStoreClient, KVTimeoutError
from awex_fast.sync.protocol import (
    INFER_META_KEY,
    MASTER_PORT_KEY,
    SIDE_METAS_FORMAT,
    TRAINING_META_KEY,
    digest_key,
)

_T = TypeVar("_T")
_Metas = list[ParameterMeta]
_SIDE_KEYS = {"training": TRAINING_META_KEY, "inference": INFER_META_KEY}


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class JoinError(RuntimeError):
    """A step of a join failed. ``step`` names the step, ``pair`` / ``kv_url`` the pair and its
    KV store, ``rank`` the missing or failing rank when one is known (else None)."""

    def __init__(self, message: str, *, step: str, pair: str | None = None, kv_url: str | None = None,
                 rank: int | None = None) -> None:
        super().__init__(message)
        self.step, self.pair, self.kv_url, self.rank = step, pair, kv_url, rank


class JoinTimeoutError(JoinError, TimeoutError):
    """A value a join step waited for did not appear in time (the peer is slow, dead or absent)."""


def step_where(step: str, pair: str | None, kv_url: str | None, rank: int | None = None) -> str:
    """``join step 'X' of pair 'P' at URL (rank R)``: how every join error starts."""
    rank_part = f" (rank {rank})" if rank is not None else ""
    return f"join step {step!r} of pair {pair!r} at {kv_url}{rank_part}"


def run_step(step: str, fn: Callable[[], _T], *, pair: str | None, kv_url: str | None,
             rank: int | None = None, error: type[JoinError] = JoinError) -> _T:
    """Run one join step; a `JoinError` passes through, any other exception becomes ``error``
    (`JoinError` or a subclass) naming the step, the pair, the KV URL and ``rank``, chained to it."""
    try:
        return fn()
    except JoinError:
        raise
    except Exception as exc:
        raise error(f"{step_where(step, pair, kv_url, rank)} failed: {type(exc).__name__}: {exc}",
                    step=step, pair=pair, kv_url=kv_url, rank=rank) from exc


def wait_value(kv: KVStoreClient, pair: str, key: str, timeout_s: float, *, step: str, who: str,
               rank: int | None = None) -> Any:
    """The KV value ``key`` of ``pair`` once ``who`` published it; `JoinTimeoutError` naming
    the step, the key, ``who`` and ``rank`` after ``timeout_s``."""
    try:
        return kv.wait(pair, key, timeout_s)
    except KVTimeoutError:
        raise JoinTimeoutError(f"{step_where(step, pair, kv.url, rank)}: {who} did not publish its metadata "
                               f"(KV key {key!r}) within {timeout_s:.0f} s",
                               step=step, pair=pair, kv_url=kv.url, rank=rank) from None


# --------------------------------------------------------------------------------------------
# Side values: the JSON under training_params_meta / infer_params_meta
# --------------------------------------------------------------------------------------------


def encode_side_metas(side: str, groups: Sequence[Sequence[ParameterMeta]], sizes: Sequence[int], *,
                      bucket_bytes: int | None = None) -> dict:
    """The KV value of ``training_params_meta`` (side "training", one group: the job) or
    ``infer_params_meta`` (side "inference", one group per engine, in engine order): side-local
    ranks, each group's metas as `metas_to_b64` inside the JSON value. ``bucket_bytes`` (in
    the training value) makes every rank plan with one bucket size, whatever it was built with."""
    if side not in _SIDE_KEYS:
        raise ValueError(f"side must be 'training' or 'inference', got {side!r}")
    if len(groups) != len(sizes):
        raise ValueError(f"{side}: {len(groups)} metadata groups but {len(sizes)} sizes")
    value = {"format": SIDE_METAS_FORMAT, "version": 1, "side": side, "rank_space": "side_local",
             "sizes": [int(s) for s in sizes], "metas": [metas_to_b64(g) for g in groups]}
    if bucket_bytes is not None:
        value["bucket_bytes"] = int(bucket_bytes)
    return value


def decode_side_metas(value: Any, side: str) -> tuple[list[int], list[list[ParameterMeta]]]:
    """Inverse of `encode_side_metas`: (sizes, per-group metas), every group validated. Raises
    `MetadataError` naming the defect (wrong format or side, sizes and groups that disagree,
    a group that is not valid base64 metas JSON, a rank outside its group)."""
    if not isinstance(value, dict) or value.get("format") != SIDE_METAS_FORMAT or value.get("version") != 1:
        raise MetadataError(f"{side} metadata in the KV store is not {SIDE_METAS_FORMAT} version 1: "
                            f"{str(value)[:120]}")
    if value.get("side") != side:
        raise MetadataError(f"KV value for the {side} side says side={value.get('side')!r}")
    sizes, blobs = value.get("sizes"), value.get("metas")
    if not isinstance(sizes, list) or not isinstance(blobs, list) or len(sizes) != len(blobs) or not sizes:
        raise MetadataError(f"{side} metadata: 'sizes' and 'metas' must be equal-length non-empty lists")
    groups = []
    for g, (size, blob) in enumerate(zip(sizes, blobs, strict=True)):
        metas = metas_from_b64(blob, what=f"{side} group {g}")
        for m in metas:
            high = max(m.ranks(), default=-1)
            if high >= size:
                raise MetadataError(f"{side} group {g} (size {size}): parameter {m.name!r} names rank {high}")
        groups.append(metas)
    return [int(s) for s in sizes], groups


def assemble_world(train_value: Any, infer_value: Any, *, infer_world_size: int, train_world_size: int,
                   num_engines: int) -> tuple[list[ParameterMeta], list[ParameterMeta]]:
    """Both sides' metadata in transfer ranks: engine ``e``'s local rank ``r`` becomes
    ``base[e] + r`` (prefix sums of the engine sizes), training rank ``t`` becomes
    ``infer_world_size + t``. Sizes that disagree with the arguments raise `MetadataError`."""
    engine_sizes, engines = decode_side_metas(infer_value, "inference")
    train_sizes, train_groups = decode_side_metas(train_value, "training")
    if len(engine_sizes) != num_engines or sum(engine_sizes) != infer_world_size:
        raise MetadataError(f"published inference sizes {engine_sizes} disagree with "
                            f"num_engines={num_engines}, infer_world_size={infer_world_size}")
    if sum(train_sizes) != train_world_size:
        raise MetadataError(f"published training sizes {train_sizes} disagree with "
                            f"train_world_size={train_world_size}")
    bases, train_base = transfer_ranks(engine_sizes, train_world_size)
    infer = merge_metas([with_rank_offset(g, b) for g, b in zip(engines, bases, strict=True)])
    tbases = [train_base + sum(train_sizes[:i]) for i in range(len(train_sizes))]
    train = merge_metas([with_rank_offset(g, b) for g, b in zip(train_groups, tbases, strict=True)])
    return train, infer


def _pieces_key(pieces: Iterable[Any]) -> list[tuple]:
    return sorted((p.global_offset, p.shape, p.local) for p in pieces)


def check_own_pieces(published: Sequence[ParameterMeta], mine: Sequence[ParameterMeta],
                     transfer_rank: int) -> None:
    """Raise `MetadataError` unless the pieces ``published`` for ``transfer_rank`` are exactly
    ``mine`` (already shifted to transfer ranks): catches a worker given another's rank."""
    by_name = {m.name: m for m in published}
    own = {m.name for m in mine if m.pieces_for_rank(transfer_rank)}
    for m in mine:
        want = _pieces_key(m.pieces_for_rank(transfer_rank))
        pub = by_name.get(m.name)
        got = _pieces_key(pub.pieces_for_rank(transfer_rank)) if pub is not None else []
        if got != want:
            raise MetadataError(f"transfer rank {transfer_rank}: parameter {m.name!r} is published with "
                                f"pieces {got[:3]} for this rank but this worker holds {want[:3]}")
    extra = sorted(m.name for m in published if m.name not in own and transfer_rank in m.ranks())
    if extra:
        raise MetadataError(f"transfer rank {transfer_rank}: the published metadata gives this rank "
                            f"parameters it does not hold: {extra[:5]}")


# --------------------------------------------------------------------------------------------
# Steps 1-3: report, publish, wait
# --------------------------------------------------------------------------------------------


def read_report(answer: Any, *, what: str) -> list[ParameterMeta]:
    """The metas of one worker's ``report_weight_meta`` answer (``{"metas": <base64>}``),
    validated; `MetadataError` naming ``what`` (the worker) otherwise."""
    if not isinstance(answer, dict) or "metas" not in answer:
        raise MetadataError(f"{what}: report_weight_meta answered {str(answer)[:120]}, not {{'metas': ...}}")
    return metas_from_b64(answer["metas"], what=what)


def merge_per_engine(per_rank: Sequence[Sequence[ParameterMeta]],
                     engine_sizes: Sequence[int]) -> list[list[ParameterMeta]]:
    """Side-local metas of every inference rank, in engine order, merged per engine."""
    if len(per_rank) != sum(engine_sizes):
        raise ValueError(f"{len(per_rank)} reports for engines of sizes {list(engine_sizes)}")
    groups, start = [], 0
    for size in engine_sizes:
        groups.append(merge_metas(per_rank[start : start + size]))
        start += size
    return groups


def gather_rank_metas(kv: KVStoreClient, pair: str, keys: Sequence[str], timeout_s: float, *, step: str,
                      who: str, decode: Callable[[Any, str], list[ParameterMeta]]) -> list[_Metas]:
    """Rank ``r``'s metas from KV key ``keys[r]`` of ``pair``, for every rank, within one
    ``timeout_s``; ``decode(value, what)`` reads one value. A rank that never published raises
    `JoinTimeoutError` naming it (``who`` is its side, e.g. "training rank")."""
    deadline = time.monotonic() + timeout_s
    out = []
    for r, key in enumerate(keys):
        value = wait_value(kv, pair, key, max(0.0, deadline - time.monotonic()), step=step,
                           who=f"{who} {r}", rank=r)
        out.append(decode(value, f"{who} {r} (KV key {key!r} of pair {pair!r})"))
    return out


def reset_group_keys(kv: KVStoreClient, pair: str, transfer_ranks_: Iterable[int] = ()) -> None:
    """Before a group is (re-)formed: delete a stale ``transfer_master_port`` (rank 0 of a port-0
    group publishes a fresh one) and the digests ``plan_digest_rank{r}`` of ``transfer_ranks_``."""
    kv.delete(pair, MASTER_PORT_KEY)
    for rank in transfer_ranks_:
        kv.delete(pair, digest_key(rank))


def put_side(kv: KVStoreClient, pair: str, value: dict) -> None:
    """Put a value `encode_side_metas` wrote under its side's KV key."""
    kv.put(pair, _SIDE_KEYS[value["side"]], value)


def publish_side(kv: KVStoreClient, pair: str, side: str, groups: Sequence[Sequence[ParameterMeta]],
                 sizes: Sequence[int], *, bucket_bytes: int | None = None) -> dict:
    """Put ``side``'s merged value (`encode_side_metas`) under its KV key; returns the value."""
    value = encode_side_metas(side, groups, sizes, bucket_bytes=bucket_bytes)
    put_side(kv, pair, value)
    return value


def publish_join_failure(kv: KVStoreClient, pair: str, reason: str) -> None:
    """Give up the join of ``pair``: every side value still awaited becomes ``{"failed": reason}``,
    so every rank waiting for one raises `JoinError` with ``reason`` at once, instead of waiting
    out its timeout (one worker's refusal must end the join everywhere). Best effort: a store that
    is gone has no waiters left to tell."""
    for key in _SIDE_KEYS.values():
        try:
            kv.put(pair, key, {"failed": str(reason)[:4000]})
        except Exception:  # noqa: BLE001 - the store may be what failed
            return


def wait_side(kv: KVStoreClient, pair: str, side: str, timeout_s: float, *,
              step: str | None = None, who: str | None = None) -> tuple[list[int], list[_Metas], dict]:
    """Wait for ``side``'s value and decode it: (sizes, per-group metas, the raw value).
    `JoinTimeoutError` when it never came; `JoinError` with the reason when the join was given
    up (`publish_join_failure`); `MetadataError` naming the key when it is malformed."""
    key = _SIDE_KEYS[side]
    step = step or f"wait for {key}"
    value = wait_value(kv, pair, key, timeout_s, step=step, who=who or f"the {side} side")
    if isinstance(value, dict) and "failed" in value:
        raise JoinError(f"{step_where(step, pair, kv.url)}: the join was given up: {value['failed']}",
                        step=step, pair=pair, kv_url=kv.url)
    try:
        sizes, groups = decode_side_metas(value, side)
    except MetadataError as exc:
        raise MetadataError(f"{step_where(step, pair, kv.url)}: KV key {key!r}: {exc}") from None
    return sizes, groups, value


# --------------------------------------------------------------------------------------------
# Step 4: the world in transfer ranks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """Sizes of a transfer world: inference engines first (in order, ranks by prefix sums of
    ``engine_sizes``), then the ``train_world_size`` training ranks."""

    engine_sizes: tuple[int, ...]
    train_world_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_sizes", tuple(int(s) for s in self.engine_sizes))
        if not self.engine_sizes or min(self.engine_sizes) < 1 or self.train_world_size < 1:
            raise ValueError(f"a world needs engines and training ranks, got engine sizes "
                             f"{list(self.engine_sizes)} and {self.train_world_size} training ranks")

    @property
    def infer_world_size(self) -> int:
        """Inference ranks in all."""
        return sum(self.engine_sizes)

    @property
    def world_size(self) -> int:
        """Transfer ranks in all."""
        return self.infer_world_size + self.train_world_size

    def inference_rank(self, engine: int, rank: int) -> int:
        """Transfer rank of rank ``rank`` of engine ``engine``."""
        return sum(self.engine_sizes[:engine]) + int(rank)

    def training_rank(self, rank: int) -> int:
        """Transfer rank of training rank ``rank``."""
        return self.infer_world_size + int(rank)

    def common_args(self, pair: str, kv_url: str) -> dict[str, Any]:
        """The sizes every rank's ``init_*`` call takes, with the pair and its KV store."""
        return {"pair_name": pair, "kv_store_url": kv_url, "infer_world_size": self.infer_world_size,
                "train_world_size": self.train_world_size, "num_engines": len(self.engine_sizes)}

    def init_args(self, pair: str, kv_url: str, master_addr: str, master_port: int,
                  transfer_rank: int) -> dict[str, Any]:
        """Keyword arguments of ``init_weight_update_group`` for ``transfer_rank``."""
        return {**self.common_args(pair, kv_url), "master_addr": master_addr, "master_port": int(master_port),
                "transfer_rank": int(transfer_rank), "world_size": self.world_size}


# --------------------------------------------------------------------------------------------
# Steps 5-6: digests and the transfer group
# --------------------------------------------------------------------------------------------


def publish_digest(kv: KVStoreClient, pair: str, transfer_rank: int, digest: str) -> None:
    """Mirror this rank's plan digest under ``plan_digest_rank{r}``."""
    kv.put(pair, digest_key(transfer_rank), digest)


def check_digests(kv: KVStoreClient, pair: str, ranks: Iterable[int]) -> str:
    """Every rank's mirrored digest; the common one, or `JoinError` naming the ranks that differ
    from rank 0's (or mirrored none)."""
    step = "compare plan digests"
    digests: dict[int, str | None] = {}
    for r in ranks:
        try:
            digests[r] = kv.get(pair, digest_key(r))
        except KVKeyError:
            digests[r] = None
    first = next(iter(digests.values()), None)
    odd = sorted(r for r, d in digests.items() if d is None or d != first)
    if first is None or odd:
        raise JoinError(f"{step_where(step, pair, kv.url, odd[0] if odd else None)}: transfer ranks planned "
                        f"from different metadata or settings: digests {digests}",
                        step=step, pair=pair, kv_url=kv.url, rank=odd[0] if odd else None)
    return first


def form_transfer_group(kv: KVStoreClient, pair: str, backend: str, master_addr: str, master_port: int,
                        transfer_rank: int, world_size: int, timeout_s: float) -> tuple[Any, Any]:
    """Join the transfer group of ``pair``: (group, the TCPStore this rank hosts or None). With
    ``master_port=0`` transfer rank 0 binds a port the OS chooses and publishes it under
    ``transfer_master_port``; the other ranks wait for it. The caller keeps the store alive."""
    from awex_fast.transport import init_transfer_group, init_transfer_group_on_free_port

    if int(master_port) != 0:
        group = init_transfer_group(backend, transfer_rank, world_size, master_addr, int(master_port),
                                    timeout=timeout_s, group_name=f"awex_{pair}")
        return group, None

    def publish(port: int) -> None:
        kv.put(pair, MASTER_PORT_KEY, {"addr": master_addr, "port": port})

    def await_port() -> tuple[str, int]:
        value = wait_value(kv, pair, MASTER_PORT_KEY, timeout_s, step="form the transfer group",
                           who="transfer rank 0", rank=0)
        return str(value.get("addr") or master_addr), int(value["port"])

    return init_transfer_group_on_free_port(backend, transfer_rank, world_size, master_addr, publish,
                                            await_port, timeout_s, f"awex_{pair}")


__all__ = ["JoinError", "JoinTimeoutError", "World", "assemble_world", "check_digests", "check_own_pieces",
           "decode_side_metas", "encode_side_metas", "form_transfer_group", "gather_rank_metas",
           "merge_per_engine", "publish_digest", "publish_join_failure", "publish_side", "put_side",
           "read_report",
           "reset_group_keys", "run_step", "step_where", "wait_side", "wait_value"]
