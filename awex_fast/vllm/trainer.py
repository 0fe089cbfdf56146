"""The trainer half of the awex_fast vLLM backend: runs on every trainer rank.

    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=r, world_size=W),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights()      # every trainer rank, every round
    engine.shutdown()

Every trainer rank sends from its own local shards (DTensor ``to_local()`` for FSDP2 / TP /
2-D modules; held full tensors for any other `WeightSource`): nothing is gathered, nothing
funnels through rank 0. Rank 0 alone talks to vLLM (the four RPCs) and, unless
``kv_store_url`` is given, hosts the KV store where both sides meet (`awex_fast.vllm.rendezvous`).
The other ranks learn its address through the default process group (a broadcast of JSON
bytes), or from ``kv_store_url`` / ``admin_api_key`` / ``pair`` given to every rank.

``client`` may be one `VLLMWeightSyncClient` or a list of them (several vLLM servers fed in one
round, engines numbered in list order).

A round that fails raises on every trainer rank (on rank 0 naming the vLLM worker and what
failed); the served weights stay at the previous version (staged mode), or, where an
``inplace`` round left them mixed, rank 0 pauses that engine's generation until a round lands
there (`awex_fast.vllm.clients.GenerationHold`); the next ``send_weights`` re-forms the transfer
group first.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

import torch
import torch.distributed as dist
import torch.nn as nn
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from awex_fast.meta import MetadataError, ParameterMeta, ShardMeta, dtype_name
from awex_fast.net import ADMIN_KEY_ENV, KVStoreClient, KVStoreServer
from awex_fast.sync import TrainingAdapter, World
from awex_fast.transport import BACKENDS, TransferError
from awex_fast.vllm import rendezvous
from awex_fast.vllm.clients import GenerationHold
from awex_fast.vllm.worker import LOAD_MODES, AwexFastWorkerInitInfo

__all__ = ["AwexFastTrainerInitInfo", "AwexFastTrainerWeightTransferEngine", "SendError", "ShardedSource"]

# How long rank 0 waits for the workers' round reports once every update RPC returned (a live
# worker writes its report before its RPC returns; only a dead server's never come).
_REPORT_GRACE_S = 10.0


class SendError(TransferError):
    """A round of `send_weights` failed; the message names the vLLM worker or trainer rank."""


@dataclass
class AwexFastTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of backend ``"awex_fast"``. Only ``rank`` and ``world_size`` (the
    number of trainer ranks) are required; the rest defaults to one host.

    ``transport``: "gloo" (default for CPU weights), "nccl" (default for CUDA weights),
    "native-nccl" or "ipc" (shared memory, one host). ``master_addr``: where inference transfer
    rank 0 binds the transfer group's rendezvous. ``kv_store_url`` / ``admin_api_key`` / ``pair``:
    an existing awex_fast KV store and the pair name to meet under (default: rank 0 hosts one on
    ``kv_host``, with a fresh key and pair name). ``load_mode``: "auto", "staged" or
    "inplace" (`awex_fast.vllm.worker`). ``timeout_s`` bounds every wait."""

    backend: ClassVar[str] = "awex_fast"

    world_size: int = 1
    transport: str | None = None
    master_addr: str = "127.0.0.1"
    kv_store_url: str | None = None
    kv_host: str = "127.0.0.1"
    admin_api_key: str | None = None
    pair: str | None = None
    timeout_s: float = 300.0
    bucket_bytes: int = 256 << 20
    load_mode: str = "auto"
    verify: bool = False

    def __post_init__(self) -> None:
        if not 0 <= int(self.rank) < int(self.world_size):
            raise ValueError(f"trainer rank {self.rank} outside world_size {self.world_size}")
        if self.transport is not None and self.transport not in BACKENDS:
            raise ValueError(f"transport must be one of {BACKENDS}, got {self.transport!r}")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {self.load_mode!r}")


def _clients(client: Any) -> list[VLLMWeightSyncClient]:
    out = list(client) if isinstance(client, (list, tuple)) else [client]
    for c in out:
        if not isinstance(c, VLLMWeightSyncClient):
            raise TypeError(f"client {c!r} lacks the VLLMWeightSyncClient methods")
    return out


def _client_name(client: Any) -> str:
    return str(getattr(client, "base_url", None) or type(client).__name__)


class _SourceTensors:
    """A generic `WeightSource` as local tensors: this rank holds its held names whole (a
    replica of each). Iterating is the source's collective, so every rank iterates each round."""

    def __init__(self, source: WeightSource, rank: int) -> None:
        self.source, self.rank = source, rank
        held = source.held_names()
        self.meta = source.metadata()
        self.held: Collection[str] | None = set(held) if held is not None else None
        self.current: dict[str, torch.Tensor] = {}

    def metas(self) -> list[ParameterMeta]:
        out = []
        for m in self.meta:
            if self.held is None or m.name in self.held:
                shape = tuple(int(s) for s in m.shape)
                out.append(ParameterMeta(m.name, shape, dtype_name(m.dtype),
                                         [ShardMeta(self.rank, (0,) * len(shape), shape)]))
        return out

    def refresh(self) -> None:
        """Iterate the source once (collective) and keep this rank's held tensors, checking each
        against the declared metadata before anything is sent."""
        declared = {m.name: m for m in self.meta}
        got: dict[str, torch.Tensor] = {}
        for name, tensor in self.source:
            if tensor is None or (self.held is not None and name not in self.held):
                continue
            m = declared.get(name)
            if m is None:
                raise MetadataError(f"WeightSource yielded {name!r}, which metadata() does not declare")
            if tuple(tensor.shape) != tuple(m.shape) or tensor.dtype != m.dtype:
                raise MetadataError(f"WeightSource yielded {name!r} as {tuple(tensor.shape)} {tensor.dtype}; "
                                    f"metadata() declares {tuple(m.shape)} {m.dtype}")
            got[name] = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        missing = sorted(n for n in (m.name for m in self.metas()) if n not in got)
        if missing:
            raise MetadataError(f"WeightSource did not yield held parameters {missing[:5]}")
        self.current = got


class ShardedSource(WeightSource):
    """A `WeightSource` over named DTensors (FSDP2 / TP / 2-D) or plain tensors under their
    canonical (Hugging Face) names, for trainers whose parameters are not one module's
    ``named_parameters()`` (renamed, or with tied aliases dropped). awex_fast sends each rank's
    local shards; iterating it (for other backends) gathers full tensors, a collective."""

    def __init__(self, named: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self.named = named

    def metadata(self) -> list[ParamMeta]:
        """(name, dtype, global shape) of every tensor, without gathering."""
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.named().items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.named().items():
            full = getattr(t, "full_tensor", None)
            yield name, full() if callable(full) else t


def _check_module_shapes(module: nn.Module, metas: Sequence[ParameterMeta]) -> None:
    """Local shards must be the size their metadata says (a stale ``.data`` rebinding would
    otherwise send or receive the wrong bytes)."""
    from awex_fast.sync.adapter_base import local_tensor as _local

    by_name = dict(module.named_parameters())
    for m in metas:
        t = by_name.get(m.name)
        if t is None:
            continue
        local = _local(t)
        for piece in m.shards:
            end = [o + s for o, s in zip(piece.local, piece.shape, strict=True)]
            if len(end) != local.dim() or any(e > d for e, d in zip(end, local.shape, strict=True)):
                raise MetadataError(f"trainer parameter {m.name!r}: local tensor {tuple(local.shape)} does "
                                    f"not hold piece {piece.global_offset}+{piece.shape}")


class AwexFastTrainerWeightTransferEngine(TrainerWeightTransferEngine[AwexFastTrainerInitInfo]):
    """Trainer engine of backend ``"awex_fast"`` (module docstring)."""

    init_info_cls = AwexFastTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None = None, is_sender: bool = True,
                 init_info: AwexFastTrainerInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.clients = _clients(client) if is_sender else []
        self.info = init_info
        self.version = 0
        self.adapter: TrainingAdapter | None = None
        self.server: KVStoreServer | None = None
        self.kv_url = self.admin_key = self.pair = ""
        self._generation = 0
        self._rejoin = False
        self._source_tensors: _SourceTensors | None = None
        self.engine_sizes: list[int] = []
        self.last_round: dict[str, Any] = {}
        self.hold = GenerationHold()  # engines paused after a round left their weights mixed

    # --- init -----------------------------------------------------------------------------------

    @classmethod
    def trainer_init(cls, init_info: AwexFastTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> Self:
        """Build the engine on every trainer rank and join the vLLM workers (collective)."""
        if source is None:
            raise ValueError("awex_fast needs a WeightSource (ModuleSource(model) for an nn.Module)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        engine._make_adapter()
        if engine._source_tensors is not None:
            engine._source_tensors.refresh()  # the group's executor binds the held tensors at join
        engine._rendezvous()
        engine._join()
        return engine

    @property
    def rank(self) -> int:
        """This trainer rank."""
        assert self.info is not None
        return int(self.info.rank)

    def _module(self) -> nn.Module | None:
        module = getattr(self.source, "_module", None) if isinstance(self.source, ModuleSource) else None
        return module if isinstance(module, nn.Module) else None

    def _make_adapter(self) -> None:
        info = self.info
        assert info is not None and self.source is not None
        module = self._module()
        if module is not None:
            source: nn.Module | Callable[[], Mapping[str, torch.Tensor]] = module
            metas = None
            first = next(iter(module.parameters()), None)
        elif isinstance(self.source, ShardedSource):
            source, metas = self.source.named, None
            first = next(iter(self.source.named().values()), None)
        else:
            self._source_tensors = st = _SourceTensors(self.source, self.rank)
            source, metas = (lambda: st.current), st.metas
            first = None
        device = first.device.type if first is not None else "cpu"
        transport = info.transport or ("nccl" if device == "cuda" else "gloo")
        self.adapter = TrainingAdapter(source, metas=metas, rank=self.rank, world_size=int(info.world_size),
                                       backend=transport, timeout_s=info.timeout_s,
                                       bucket_bytes=info.bucket_bytes, verify=info.verify,
                                       admin_api_key="unused")  # set once the KV key is known
        self.transport = transport

    def _rendezvous(self) -> None:
        """Agree on the KV store, its key and the pair name on every trainer rank."""
        info = self.info
        assert info is not None
        key = info.admin_api_key or os.environ.get(ADMIN_KEY_ENV) or ""
        url, pair = info.kv_store_url or "", info.pair or ""
        if self.rank == 0:
            if not url:
                key = key or secrets.token_hex(16)
                self.server = KVStoreServer(info.kv_host, 0, key).start()
                url = self.server.url
            pair = pair or f"vllm-{secrets.token_hex(6)}"
        shared = {"url": url, "key": key, "pair": pair}
        if int(info.world_size) > 1 and not (info.kv_store_url and info.pair and key):
            shared = _broadcast_json(shared, int(info.world_size))
        self.kv_url, self.admin_key, self.pair = shared["url"], shared["key"], shared["pair"]
        if not self.kv_url or not self.admin_key:
            raise ValueError("awex_fast: no KV store; give kv_store_url and admin_api_key to every rank")
        assert self.adapter is not None
        self.adapter.admin_api_key = self.admin_key

    def _round_pair(self) -> str:
        # a fresh name per (re)join: keys of a failed attempt never leak into the next
        return f"{self.pair}-g{self._generation}"

    def _engine_names(self) -> list[str]:
        return [_client_name(c) for c in self.clients]

    def _worker_init(self, engine: int) -> dict[str, Any]:
        info = self.info
        assert info is not None
        return asdict(AwexFastWorkerInitInfo(
            kv_store_url=self.kv_url, admin_api_key=self.admin_key, pair=self._round_pair(),
            train_world_size=int(info.world_size), engine_index=engine, num_engines=len(self.clients),
            master_addr=info.master_addr, backend=self.transport, timeout_s=info.timeout_s,
            load_mode=info.load_mode, verify=info.verify))

    def _join(self) -> None:
        """Publish, (rank 0) drive the workers' init and merge both sides, join the group."""
        info, adapter = self.info, self.adapter
        assert info is not None and adapter is not None
        pair, world, t0 = self._round_pair(), int(info.world_size), time.perf_counter()
        kv = KVStoreClient(self.kv_url, self.admin_key)
        pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients))) if self.is_sender else None
        inits: list[tuple[str, Future]] = []
        try:
            if self._module() is not None:
                _check_module_shapes(self._module(), adapter.get_weight_metadata())  # type: ignore[arg-type]
            rendezvous.publish_training_rank(kv, pair, self.rank, world, adapter.get_weight_metadata())
            if self.is_sender:
                assert pool is not None
                inits = [(_client_name(c), pool.submit(c.init_weight_transfer_engine, self._worker_init(e)))
                         for e, c in enumerate(self.clients)]
                rendezvous.collect_training(kv, pair, world, info.timeout_s, info.bucket_bytes)
                sizes = _collect_or_fail(kv, pair, inits, info.timeout_s)
            else:
                sizes = rendezvous.engine_sizes(kv, pair, info.timeout_s)
            tw = World(tuple(sizes), world)
            adapter.init_weight_update_group(**tw.init_args(pair, self.kv_url, info.master_addr, 0,
                                                            tw.training_rank(self.rank)))
            adapter.batch_isend_irecv()
            for where, fut in inits:
                _result(fut, where, "init_weight_transfer_engine", info.timeout_s)
            if self.is_sender:
                _raise_worker_errors(kv, pair, sizes, self._engine_names(), "joined", info.timeout_s)
            self.engine_sizes = sizes
        except BaseException:
            adapter.teardown_weight_update_group()
            raise
        finally:
            kv.close()
            if pool is not None:
                pool.shutdown(wait=False)
        self._rejoin = False
        self.join_seconds = time.perf_counter() - t0

    # --- rounds ---------------------------------------------------------------------------------

    def send_weights(self, version: int | None = None) -> None:
        """One round on every trainer rank: send this rank's boxes of the next version (or
        ``version``); rank 0 drives start / update / finish on every vLLM engine. Raises
        `SendError` on every rank if any rank or worker failed."""
        info, adapter = self.info, self.adapter
        assert info is not None and adapter is not None
        version = self.version + 1 if version is None else int(version)
        t0 = time.perf_counter()
        if self._rejoin:
            self._generation += 1
            self._join()
        error: BaseException | None = None
        timings: dict[str, float] = {}
        try:
            if self._source_tensors is not None:
                self._source_tensors.refresh()
            if self.is_sender:
                timings = self._drive_round(version)
            else:
                adapter.execute_weight_update(version)
        except BaseException as exc:  # noqa: BLE001 - every rank must hear of it before anyone raises
            error = exc
        failed = _ranks_where(error is not None, int(info.world_size), self.rank)
        if failed:
            self._rejoin = True
            adapter.teardown_weight_update_group()
            if error is not None:
                if isinstance(error, SendError):
                    raise error
                raise SendError(f"trainer rank {self.rank}: round {version} failed: {error}",
                                version=version) from error
            raise SendError(f"trainer rank {self.rank}: round {version} failed on trainer ranks {failed}",
                            version=version)
        self.version = version
        self.last_round = {"version": version, "seconds": time.perf_counter() - t0, **timings}

    def _drive_round(self, version: int) -> dict[str, float]:
        """Rank 0: start on every engine, receive concurrently with this rank's sends, then finish
        each engine by its own workers' outcome: one whose workers all loaded the round is
        labelled ``version``, the others close vLLM's session unlabelled (their weights did not
        change: `awex_fast.vllm.worker`). Raises `SendError` naming the engines that failed and
        the ones that moved on, so every server serves one whole version that it reports."""
        info, adapter = self.info, self.adapter
        assert info is not None and adapter is not None
        timeout = info.timeout_s
        names = self._engine_names()
        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            t0 = time.perf_counter()
            _all(pool, self.clients, "start_weight_update", lambda c: c.start_weight_update(), timeout)
            t1 = time.perf_counter()
            updates = [(_client_name(c), pool.submit(c.update_weights, {"version": version}))
                       for c in self.clients]
            send_error: BaseException | None = None
            try:
                adapter.execute_weight_update(version)
            except BaseException as exc:  # noqa: BLE001 - the workers' own errors say more
                send_error = exc
            t2 = time.perf_counter()
            failures: list[list[str]] = []
            for where, fut in updates:
                try:
                    _result(fut, where, "update_weights", timeout)
                    failures.append([])
                except SendError as exc:
                    failures.append([str(exc)])
            # Every update RPC has returned, and a live worker reports before its RPC returns: the
            # reports are already there, unless the server is gone.
            kv = KVStoreClient(self.kv_url, self.admin_key)
            try:
                reports = rendezvous.engine_errors(kv, self._round_pair(), self.engine_sizes, names,
                                                   f"round{version}", min(timeout, _REPORT_GRACE_S))
            finally:
                kv.close()
            for errors, worker_errors in zip(failures, reports, strict=True):
                errors += worker_errors
            t3 = time.perf_counter()
            # weight_version None closes vLLM's session unlabelled (the sync client protocol)
            finishes = [pool.submit(c.finish_weight_update, None if errors else str(version))
                        for c, errors in zip(self.clients, failures, strict=True)]
            for where, fut, errors in zip(names, finishes, failures, strict=True):
                try:
                    _result(fut, where, "finish_weight_update", timeout)
                except SendError as exc:  # its label is unknown now: count it as failed
                    errors.append(str(exc))
            t4 = time.perf_counter()
        holds = [self.hold.after_round(name, c, errors)
                 for name, c, errors in zip(names, self.clients, failures, strict=True)]
        failed = [names[e] for e, errors in enumerate(failures) if errors]
        if failed or send_error is not None:
            moved = [names[e] for e, errors in enumerate(failures) if not errors]
            why = "; ".join(m for errors in failures for m in errors)
            if send_error is not None:
                why = f"{why}; sending failed: {send_error}" if why else f"sending failed: {send_error}"
            outcome = (f"{', '.join(moved)} now serve version {version}" if moved else
                       "every engine keeps its previous weights and version")
            outcome = "; ".join([outcome, *(h for h in holds if h)])
            raise SendError(f"round {version} failed on {', '.join(failed) or 'the trainer'}: {why} "
                            f"({outcome})", version=version) from send_error
        return {"start_s": t1 - t0, "send_s": t2 - t1, "update_s": t3 - t1, "finish_s": t4 - t3}

    def shutdown(self) -> None:
        """Leave the transfer group and stop the KV store this rank hosts."""
        if self.adapter is not None:
            self.adapter.teardown_weight_update_group()
        if self.is_sender:
            for c in self.clients:
                stop = getattr(c, "shutdown_weight_transfer_engine", None)
                if stop is not None:
                    with contextlib.suppress(Exception):  # a dead server has nothing to shut down
                        stop()
        if self.server is not None:
            self.server.stop()
            self.server = None


# --- helpers --------------------------------------------------------------------------------------


def _raise_worker_errors(kv: KVStoreClient, pair: str, sizes: list[int], engines: list[str], what: str,
                         timeout: float) -> None:
    errors = rendezvous.worker_errors(kv, pair, sizes, engines, what, timeout)
    if errors:
        raise rendezvous.WorkerInitError("; ".join(errors))


def _result(fut: Future, where: str, what: str, timeout: float) -> Any:
    try:
        return fut.result(timeout=timeout)
    except TimeoutError:
        raise SendError(f"vLLM at {where}: {what} did not answer within {timeout:.0f} s") from None
    except BaseException as exc:
        detail = _http_detail(exc)
        raise SendError(f"vLLM at {where}: {what} failed: {detail}") from exc


def _http_detail(exc: BaseException) -> str:
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


def _all(pool: ThreadPoolExecutor, clients: list, what: str, call: Callable[[Any], Any],
         timeout: float) -> None:
    futures = [(_client_name(c), pool.submit(call, c)) for c in clients]
    errors = []
    for where, fut in futures:
        try:
            _result(fut, where, what, timeout)
        except SendError as exc:
            errors.append(str(exc))
    if errors:
        raise SendError("; ".join(errors))


def _collect_or_fail(kv: KVStoreClient, pair: str, inits: list[tuple[str, Future]],
                     timeout: float) -> list[int]:
    """Rank 0: merge the workers' metadata; if a worker's init RPC fails first (an unknown
    backend, a bad request), raise that instead of waiting out the timeout."""
    done = threading.Event()
    result: dict[str, Any] = {}

    def collect() -> None:
        try:
            result["sizes"] = rendezvous.collect_inference(kv, pair, [w for w, _ in inits], timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            result["error"] = exc
        done.set()

    threading.Thread(target=collect, daemon=True, name="awex-collect").start()
    while not done.wait(0.2):
        for where, fut in inits:
            if fut.done() and fut.exception() is not None:
                _result(fut, where, "init_weight_transfer_engine", timeout)
    if "error" in result:
        raise result["error"]
    return result["sizes"]


def _default_group_size() -> int | None:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def _broadcast_json(value: dict, world_size: int) -> dict:
    """Rank 0's ``value`` on every rank, through the default process group (JSON bytes)."""
    if _default_group_size() != world_size:
        raise ValueError(f"awex_fast: {world_size} trainer ranks but no default process group of that "
                         "size to share the KV store address; give kv_store_url, admin_api_key and pair "
                         "to every rank")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return json.loads(bytes(buf.cpu().tolist()))


def _ranks_where(flag: bool, world_size: int, rank: int) -> list[int]:
    """The trainer ranks where ``flag`` holds (all-reduced over the default group when it spans
    the trainer; otherwise only this rank's own view)."""
    if _default_group_size() != world_size or world_size == 1:
        return [rank] if flag else []
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flags = torch.zeros(world_size, dtype=torch.int64, device=device)
    flags[dist.get_rank()] = int(flag)
    dist.all_reduce(flags)
    return [r for r in range(world_size) if int(flags[r])]
