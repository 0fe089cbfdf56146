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
round; the engines number themselves as they join). A round, receiving while serving (the
default): rank 0 announces it in the KV store and starts it on every engine (each worker begins
receiving in the background and says so), every rank sends while vLLM keeps generating, then
``update_weights`` has vLLM apply the landed bytes (the only pause) and ``finish_weight_update``
labels the version; with ``receive_while_serving=False`` the update RPC runs during the sends.

A round that fails raises on every trainer rank (on rank 0 naming the vLLM worker and what
failed); the served weights stay at the previous version (staged mode), or, where an
``inplace`` round left them mixed, rank 0 pauses that engine's generation until a round lands
there (`awex_fast.vllm.clients.GenerationHold`); the next ``send_weights`` re-forms the transfer
group first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Self

import torch
import torch.nn as nn
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerWeightTransferEngine,
    WeightSource,
)

from awex_fast.layouts import metas_from_dtensors
from awex_fast.meta import MetadataError
from awex_fast.net import ADMIN_KEY_ENV, KVStoreClient, KVStoreServer
from awex_fast.sync import TrainingAdapter, World, join
from awex_fast.sync.adapter_base import local_tensor
from awex_fast.transfer.fp8 import QuantizationError
from awex_fast.vllm import rendezvous
from awex_fast.vllm.addresses import resolve_addresses
from awex_fast.vllm.calls import (
    SendError,
    call_all,
    client_name,
    clients_of,
    collect_or_fail,
    numeric_label,
    raise_worker_errors,
    result,
)
from awex_fast.vllm.clients import GenerationHold, current_label
from awex_fast.vllm.fp8_sender import QuantizingSource
from awex_fast.vllm.sources import (
    ShardedSource,
    SourceTensors,
    check_module_shapes,
    fingerprints,
    first_change,
)
from awex_fast.vllm.trainer_group import all_reduce_max, broadcast_json, default_group_size, ranks_where
from awex_fast.vllm.trainer_info import AwexFastTrainerInitInfo
from awex_fast.vllm.worker import AwexFastWorkerInitInfo

__all__ = ["AwexFastTrainerInitInfo", "AwexFastTrainerWeightTransferEngine", "SendError", "ShardedSource"]

logger = logging.getLogger(__name__)

# How long rank 0 waits for the workers' round reports once every update RPC returned (a live
# worker writes its report before its RPC returns; only a dead server's never come).
_REPORT_GRACE_S = 10.0


class AwexFastTrainerWeightTransferEngine(TrainerWeightTransferEngine[AwexFastTrainerInitInfo]):
    """Trainer engine of backend ``"awex_fast"`` (module docstring)."""

    init_info_cls = AwexFastTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None = None, is_sender: bool = True,
                 init_info: AwexFastTrainerInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.clients = clients_of(client) if is_sender else []
        self.info = init_info
        self.version: int | str = 0  # the label of the last round that landed (the caller's, or a count)
        self._counter = 0  # the last numeric label: the default label of the next round is one more
        self._round = 0  # this engine's rounds, as the wire numbers them (never the caller's label)
        self.world_size = 1  # trainer ranks (`AwexFastTrainerInitInfo.trainer_world`)
        self._check_world: int | None = None  # a given world_size to check once the workers are known
        self._bound_source: WeightSource | None = None
        self._joined: list[tuple[str, str]] = []  # fingerprints of this rank's metadata at the join
        self.adapter: TrainingAdapter | None = None
        self.server: KVStoreServer | None = None
        self.kv_url = self.admin_key = self.pair = ""
        self.master_address = "127.0.0.1"  # the transfer rendezvous (`awex_fast.vllm.addresses`)
        self._generation = 0
        self._rejoin = False
        self._source_tensors: SourceTensors | None = None
        self._fp8_targets: dict[str, tuple[int, int]] = {}  # weights this trainer quantizes to FP8
        self._quantizer: QuantizingSource | None = None
        self.engine_sizes: list[int] = []
        self.engines: list[rendezvous.EngineClaim] = []  # rank 0: every engine, in transfer order
        self.last_round: dict[str, Any] = {}
        self.hold = GenerationHold()  # engines paused after a round left their weights mixed
        # clients whose vLLM weight-update session this rank opened and has not closed: vLLM
        # refuses to shut the connection down inside one, and (0.32's multiprocess executor)
        # a refusal on worker 0 leaves the other workers' replies queued for the next RPC
        self._open_sessions: set[int] = set()

    # --- init -----------------------------------------------------------------------------------

    @classmethod
    def trainer_init(cls, init_info: AwexFastTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> Self:
        """Build the engine on every trainer rank and join the vLLM workers (collective)."""
        if source is None:
            raise ValueError("awex_fast needs a WeightSource (ModuleSource(model) for an nn.Module)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        engine.world_size, engine._check_world = init_info.trainer_world()
        if not engine.rank < engine.world_size:
            raise ValueError(f"trainer rank {engine.rank} outside the trainer's {engine.world_size} ranks "
                             f"(world_size {init_info.world_size}, default process group "
                             f"{default_group_size()}); give world_size = the number of trainer ranks")
        engine._make_adapter()
        engine._rendezvous()
        engine._join()
        engine._adopt_fp8()
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
        first = self._bind_source()
        device = first.device.type if first is not None else "cpu"
        transport = info.transport or ("nccl" if device == "cuda" else "gloo")
        assert self.adapter is not None
        self.adapter.backend = transport
        self.transport = transport

    def _bind_source(self) -> torch.Tensor | None:
        """Point the adapter at ``self.source`` as it is now (it may have been reassigned since
        the last round, as vLLM's own engines allow) and read a generic source once; returns its
        first tensor (for the device), if it is known without iterating."""
        info = self.info
        assert info is not None and self.source is not None
        module = self._module()
        self._source_tensors = None
        if module is not None:
            source: nn.Module | Callable[[], Mapping[str, torch.Tensor]] = module
            metas = None
            first = next(iter(module.parameters()), None)
        elif isinstance(self.source, ShardedSource):
            source, metas = self.source.named, None
            first = next(iter(self.source.named().values()), None)
        else:
            self._source_tensors = st = SourceTensors(self.source, self.rank)
            source, metas = (lambda: st.current), st.metas
            first = None
        self._quantizer = None
        if self._fp8_targets:
            source, metas = self._quantizing(source, metas)
        if self.adapter is None:
            self.adapter = TrainingAdapter(source, metas=metas, rank=self.rank, world_size=self.world_size,
                                           backend="gloo", timeout_s=info.timeout_s,
                                           bucket_bytes=info.bucket_bytes, verify=info.verify,
                                           admin_api_key="unused")  # set once the KV key is known
        else:
            self.adapter.set_source(source, metas)
        self._bound_source = self.source
        if self._source_tensors is not None:
            self._source_tensors.refresh()  # iterate now: a collective every rank runs
        return first

    def _quantizing(self, source: Any, metas: Any) -> tuple[Callable[[], Mapping[str, torch.Tensor]], Any]:
        """``source`` / ``metas`` with the FP8 targets quantized on this rank (`QuantizingSource`;
        filled by its ``refresh``, every round)."""
        named = (lambda: dict(source.named_parameters())) if isinstance(source, nn.Module) else source
        base_metas = ((lambda: metas_from_dtensors(list(named().items()), self.rank)) if metas is None else
                      metas if callable(metas) else (lambda: metas))
        local = lambda: {n: local_tensor(t) for n, t in named().items()}  # noqa: E731
        self._quantizer = q = QuantizingSource(base_metas, local, self._fp8_targets, self.rank,
                                               lambda t: all_reduce_max(t, self.world_size))
        return q.tensors, q.metas

    def _adopt_fp8(self) -> None:
        """After the first join: where the workers hold weights in block FP8 (each engine's worker
        0 names them), quantize them here from now on and join again with e4m3 + scales
        (``fp8_quantize="trainer"``; every rank reads the names from the store itself)."""
        info = self.info
        assert info is not None
        if info.fp8_quantize != "trainer" or self._fp8_targets:
            return
        if self.world_size > 1 and default_group_size() != self.world_size:
            return  # no group to agree on block scales over: the workers quantize
        kv = KVStoreClient(self.kv_url, self.admin_key)
        try:
            targets = rendezvous.fp8_targets(kv, self._round_pair(), len(self.engine_sizes))
        finally:
            kv.close()
        if not targets:
            return
        self._fp8_targets = targets
        self._bind_source()
        assert self._quantizer is not None
        self._quantizer.refresh()  # collective, on every rank
        self._generation += 1
        self._join()

    def _rendezvous(self) -> None:
        """Agree on the KV store, its key and the pair name on every trainer rank."""
        info = self.info
        assert info is not None
        key = info.admin_api_key or os.environ.get(ADMIN_KEY_ENV) or ""
        url, pair = info.kv_store_url or "", info.pair or ""
        master = info.master_address or "127.0.0.1"  # ranks > 0 use the address rank 0 publishes
        if self.rank == 0:
            kv_host, master = resolve_addresses(self.clients, info.kv_host, info.master_address)
            if not url:
                key = key or secrets.token_hex(16)
                self.server = KVStoreServer(kv_host, 0, key).start()
                url = self.server.url
            pair = pair or f"vllm-{secrets.token_hex(6)}"
            labels = [n for n in map(numeric_label, self._server_labels()) if n is not None]
            self._counter = max([0, *labels])
        shared = {"url": url, "key": key, "pair": pair, "counter": self._counter, "master": master}
        if self.world_size > 1 and not (info.kv_store_url and info.pair and key):
            shared = broadcast_json(shared, self.world_size)
        self.kv_url, self.admin_key, self.pair = shared["url"], shared["key"], shared["pair"]
        self._counter = int(shared.get("counter", self._counter))
        self.master_address = str(shared.get("master", master))
        self.version = self._counter
        if not self.kv_url or not self.admin_key:
            raise ValueError("awex_fast: no KV store; give kv_store_url and admin_api_key to every rank")
        assert self.adapter is not None
        self.adapter.admin_api_key = self.admin_key

    def _server_labels(self) -> list[str | None]:
        """Rank 0: the weight version every server reports now (None where it cannot say)."""
        return [current_label(c, self.info.timeout_s if self.info else 30.0) for c in self.clients]

    def _master_port(self) -> int:
        # a given master_port serves the first join only: after an abort it may still be held
        assert self.info is not None
        return int(self.info.master_port) if self._generation == 0 else 0

    def _round_pair(self) -> str:
        # a fresh name per (re)join: keys of a failed attempt never leak into the next
        return f"{self.pair}-g{self._generation}"

    def _client_names(self) -> list[str]:
        return [client_name(c) for c in self.clients]

    def _engine_names(self) -> list[str]:
        """Per engine (in the claimed order), how errors name it (`rendezvous.EngineClaim.name`)."""
        clients = self._client_names()
        per_client = [sum(e.client == c for e in self.engines) for c in range(len(clients))]
        return [e.name(clients[e.client], per_client[e.client] == 1) for e in self.engines]

    def _worker_init(self, claim_client: int | None = None) -> dict[str, Any]:
        """The workers' init info: step 0's claim behind client ``claim_client``, else the join."""
        info = self.info
        assert info is not None
        return asdict(AwexFastWorkerInitInfo(
            kv_store_url=self.kv_url, admin_api_key=self.admin_key, pair=self._round_pair(),
            train_world_size=self.world_size, engine_index=-1, num_engines=max(1, len(self.engines)),
            claim=claim_client is not None, claim_client=claim_client or 0,
            master_addr=self.master_address, master_port=self._master_port(), backend=self.transport,
            timeout_s=info.timeout_s, load_mode=info.load_mode, verify=info.verify,
            receive_while_serving=info.receive_while_serving))

    def _claim_engines(self, kv: KVStoreClient, pool: ThreadPoolExecutor) -> None:
        """Rank 0, step 0 (`awex_fast.vllm.rendezvous`): every client's engines claim a place,
        whatever number of servers a client stands for; then order them."""
        assert self.info is not None
        clients = self._client_names()
        claims = [(name, pool.submit(c.init_weight_transfer_engine, self._worker_init(claim_client=i)))
                  for i, (name, c) in enumerate(zip(clients, self.clients, strict=True))]
        for where, fut in claims:
            result(fut, where, "init_weight_transfer_engine (claim)", self.info.timeout_s)
        self.engines = rendezvous.order_engines(kv, self._round_pair(), clients)

    def _join(self) -> None:
        """Publish, (rank 0) drive the workers' init and merge both sides, join the group."""
        info, adapter = self.info, self.adapter
        assert info is not None and adapter is not None
        pair, world, t0 = self._round_pair(), self.world_size, time.perf_counter()
        kv = KVStoreClient(self.kv_url, self.admin_key)
        pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients))) if self.is_sender else None
        inits: list[tuple[str, Future]] = []
        try:
            if self._module() is not None:
                check_module_shapes(self._module(), adapter.get_weight_metadata())  # type: ignore[arg-type]
            rendezvous.publish_training_rank(kv, pair, self.rank, world, adapter.get_weight_metadata())
            if self.is_sender:
                assert pool is not None
                self._claim_engines(kv, pool)
                inits = [(name, pool.submit(c.init_weight_transfer_engine, self._worker_init()))
                         for name, c in zip(self._client_names(), self.clients, strict=True)]
                rendezvous.collect_training(kv, pair, world, info.timeout_s, info.bucket_bytes)
                sizes = collect_or_fail(kv, pair, self._engine_names(), inits, info.timeout_s,
                                         self._check_world_size)
            else:
                sizes = rendezvous.engine_sizes(kv, pair, info.timeout_s)
                self._check_world_size(sizes)
            tw = World(tuple(sizes), world)
            # a given master_port serves the first join only: after an abort it may still be held
            adapter.init_weight_update_group(**tw.init_args(pair, self.kv_url, self.master_address,
                                                            self._master_port(),
                                                            tw.training_rank(self.rank)))
            adapter.batch_isend_irecv()
            for where, fut in inits:
                result(fut, where, "init_weight_transfer_engine", info.timeout_s)
            if self.is_sender:
                raise_worker_errors(kv, pair, sizes, self._engine_names(), "joined", info.timeout_s)
            self.engine_sizes = sizes
            self._joined = fingerprints(adapter.get_weight_metadata())
        except BaseException as exc:
            # every rank and worker still waiting for this join leaves it now, with the reason,
            # instead of waiting out its timeout (a refusal on one worker ends it everywhere)
            join.publish_join_failure(kv, pair, f"trainer rank {self.rank}: {exc}")
            adapter.teardown_weight_update_group()
            raise
        finally:
            kv.close()
            if pool is not None:
                pool.shutdown(wait=False)
        self._rejoin = False
        self.join_seconds = time.perf_counter() - t0

    def _check_world_size(self, sizes: Sequence[int]) -> None:
        """A given ``world_size`` that is not the trainer's rank count must be vLLM's meaning of
        it (trainer ranks + every vLLM worker); anything else is refused naming both numbers."""
        given = self._check_world
        if given is None:
            return
        workers = int(sum(sizes))
        if given != self.world_size + workers:
            raise ValueError(f"awex_fast: world_size {given} is neither the trainer's {self.world_size} "
                             "ranks (the default process group's size, 1 without one) nor trainer ranks + "
                             f"vLLM workers ({self.world_size} + {workers} = {self.world_size + workers}); "
                             "give world_size = the number of trainer ranks, or leave it out")

    # --- rounds ---------------------------------------------------------------------------------

    def send_weights(self, version: int | str | None = None) -> None:
        """One round on every trainer rank: send what the source holds *now* (read again every
        round; a reassigned ``engine.source`` is honoured); rank 0 drives start / update / finish
        on every vLLM engine. ``version``: the label the servers report once the round landed
        (vLLM's ``weight_version``), used as given; default: one more than the last numeric
        label (at first the servers' own). A source whose metadata changed since the join makes
        every rank re-plan (re-join) first. Raises `SendError` on every rank if any rank or worker
        failed."""
        info, adapter = self.info, self.adapter
        assert info is not None and adapter is not None
        label: int | str = self._counter + 1 if version is None else version
        self._round += 1
        rnd, t0 = self._round, time.perf_counter()
        changed = False
        error: BaseException | None = None
        try:
            changed = self._read_source()
        except BaseException as exc:  # noqa: BLE001 - every rank must hear of it before anyone raises
            error = exc
        failed = ranks_where(error is not None, self.world_size, self.rank)
        if failed:  # nothing was sent: the transfer group is intact
            if error is not None:
                raise SendError(f"trainer rank {self.rank}: round {label}: reading the source failed, "
                                f"nothing was sent: {error}", version=rnd) from error
            raise SendError(f"trainer rank {self.rank}: round {label}: reading the source failed on trainer "
                            f"ranks {failed}; nothing was sent", version=rnd)
        self._quantize(label, rnd)
        if ranks_where(changed, self.world_size, self.rank):
            self._rejoin = True  # the plan no longer describes the source: plan again
        if self._rejoin:
            self._generation += 1
            self._join()
        timings: dict[str, float] = {}
        try:
            if self.is_sender:
                timings = self._drive_round(rnd, str(label))
            else:
                timings = {"bytes_sent": int(adapter.execute_weight_update(rnd).get("bytes_sent", 0))}
        except BaseException as exc:  # noqa: BLE001 - every rank must hear of it before anyone raises
            error = exc
        failed = ranks_where(error is not None, self.world_size, self.rank)
        if failed:
            self._rejoin = True
            adapter.teardown_weight_update_group()
            if error is not None:
                if isinstance(error, SendError):
                    raise error
                raise SendError(f"trainer rank {self.rank}: round {label} failed: {error}",
                                version=rnd) from error
            raise SendError(f"trainer rank {self.rank}: round {label} failed on trainer ranks {failed}",
                            version=rnd)
        self.version = label
        numeric = numeric_label(label)
        if numeric is not None:
            self._counter = numeric
        self.last_round = {"version": label, "round": rnd, "replanned": changed,
                           "seconds": time.perf_counter() - t0, **timings}

    def _quantize(self, label: int | str, rnd: int) -> None:
        """Quantize this round's FP8 targets (collective), every rank raising if any rank failed."""
        if self._quantizer is None:
            return
        error: BaseException | None = None
        try:
            self._quantizer.refresh()
        except QuantizationError as exc:
            error = exc
        failed = ranks_where(error is not None, self.world_size, self.rank)
        if failed:
            why = f": {error}" if error else ""
            raise SendError(f"trainer rank {self.rank}: round {label}: quantizing to FP8 failed on trainer "
                            f"ranks {failed}, nothing was sent{why}", version=rnd)

    def _read_source(self) -> bool:
        """Read the source for this round (bind it again if ``engine.source`` was reassigned;
        iterate a generic source); returns whether this rank's metadata differs from the join's.
        Where the trainer ranks cannot agree on a re-plan (no default process group spanning
        them), a change is refused here instead, naming the parameter."""
        if self.source is not self._bound_source:
            self._bind_source()
        elif self._source_tensors is not None:
            self._source_tensors.refresh()
        assert self.adapter is not None
        now = fingerprints(self.adapter.get_weight_metadata())
        if now == self._joined:
            return False
        if self.world_size > 1 and default_group_size() != self.world_size:
            raise MetadataError(f"trainer rank {self.rank}: {first_change(self._joined, now)} since the "
                                "join, and without a default process group over the trainer ranks they "
                                "cannot agree to plan again; call trainer_init again")
        return True

    def _drive_round(self, rnd: int, label: str) -> dict[str, float]:
        """Rank 0: start on every engine, receive concurrently with this rank's sends, then finish
        each engine by its own workers' outcome: one whose workers all loaded the round is
        labelled ``label``, the others close vLLM's session unlabelled (their weights did not
        change: `awex_fast.vllm.worker`). Raises `SendError` naming the engines that failed and
        the ones that moved on, so every server serves one whole version that it reports."""
        info, adapter = self.info, self.adapter
        assert info is not None and adapter is not None
        timeout = info.timeout_s
        clients = self._client_names()
        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            t0 = time.perf_counter()
            serving = info.receive_while_serving
            self._start(pool, rnd, label, serving, timeout)
            t1 = time.perf_counter()

            def update() -> list[tuple[str, Future]]:
                return [(name, pool.submit(c.update_weights, {"version": rnd}))
                        for name, c in zip(clients, self.clients, strict=True)]

            # serving: vLLM keeps generating while the bytes land; its update RPC only applies them
            updates = [] if serving else update()
            send_error: BaseException | None = None
            sent = 0
            try:
                sent = int(adapter.execute_weight_update(rnd).get("bytes_sent", 0))
            except BaseException as exc:  # noqa: BLE001 - the workers' own errors say more
                send_error = exc
            t2 = time.perf_counter()
            if serving:  # also after a failed send: the workers report, and the sessions close
                updates = update()
            failures: list[list[str]] = []  # per client: its RPC's and its engines' workers' errors
            for where, fut in updates:
                try:
                    result(fut, where, "update_weights", timeout)
                    failures.append([])
                except SendError as exc:
                    failures.append([str(exc)])
            for client, worker_errors in enumerate(self._reports(f"round{rnd}", timeout)):
                failures[client] += worker_errors
            t3 = time.perf_counter()
            # weight_version None closes vLLM's session unlabelled (the sync client protocol). A
            # client over several servers labels all or none: one server that failed keeps all
            # of that client's servers unlabelled (the others then serve the round's weights
            # under their previous label, and the error says so)
            finishes = [pool.submit(c.finish_weight_update, None if errors else label)
                        for c, errors in zip(self.clients, failures, strict=True)]
            for i, (where, fut, errors) in enumerate(zip(clients, finishes, failures, strict=True)):
                try:
                    result(fut, where, "finish_weight_update", timeout)
                    self._open_sessions.discard(i)
                except SendError as exc:  # its label is unknown now: count it as failed
                    errors.append(str(exc))
            t4 = time.perf_counter()
        holds = [self.hold.after_round(name, c, errors)
                 for name, c, errors in zip(clients, self.clients, failures, strict=True)]
        failed = [clients[c] for c, errors in enumerate(failures) if errors]
        if failed or send_error is not None:
            moved = [clients[c] for c, errors in enumerate(failures) if not errors]
            why = "; ".join(m for errors in failures for m in errors)
            if send_error is not None:
                why = f"{why}; sending failed: {send_error}" if why else f"sending failed: {send_error}"
            outcome = (f"{', '.join(moved)} now serve version {label}" if moved else
                       "every engine keeps its previous weights and version")
            outcome = "; ".join([outcome, *(h for h in holds if h)])
            raise SendError(f"round {label} failed on {', '.join(failed) or 'the trainer'}: {why} "
                            f"({outcome})", version=rnd) from send_error
        # serving: update_s is the apply alone (the stall), receive_s the transfer vLLM served through
        return {"start_s": t1 - t0, "send_s": t2 - t1, "update_s": t3 - (t2 if serving else t1),
                "finish_s": t4 - t3, "bytes_sent": sent, **({"receive_s": t2 - t1} if serving else {})}

    def _start(self, pool: ThreadPoolExecutor, rnd: int, label: str, serving: bool, timeout: float) -> None:
        """Rank 0: open round ``rnd``'s session on every engine (``serving``: announce the round
        first, and see every worker receiving it); raises `SendError`, with every session this
        rank opened closed again, when any engine could not start."""
        leftover = self._close_sessions(pool, timeout)  # a round that failed before its finish
        if leftover:
            raise SendError(f"round {label}: nothing was sent{leftover}", version=rnd)
        if serving:  # the round the workers start receiving at their start RPC
            with contextlib.closing(KVStoreClient(self.kv_url, self.admin_key)) as kv:
                rendezvous.announce_round(kv, self._round_pair(), rnd)
        started = call_all(pool, self.clients, "start_weight_update", lambda c: c.start_weight_update(),
                           timeout)
        self._open_sessions.update(i for i, error in enumerate(started) if error is None)
        if not any(started) and serving:  # every worker receives already, or says why not
            started = ["; ".join(e) or None for e in self._reports(f"receiving{rnd}", timeout)]
        if any(started):
            closing = self._close_sessions(pool, timeout)
            why = "; ".join(e for e in started if e)
            raise SendError(f"round {label}: {why}; nothing was sent (every engine keeps its previous "
                            f"weights and version{closing})", version=rnd)

    def _reports(self, what: str, timeout: float) -> list[list[str]]:
        """Per client, its engines' workers' errors for ``what`` (``round<v>``, ``receiving<v>``):
        a live worker reports before its RPC returns, so they are in unless a server is gone."""
        with contextlib.closing(KVStoreClient(self.kv_url, self.admin_key)) as kv:
            reports = rendezvous.engine_errors(kv, self._round_pair(), self.engine_sizes,
                                               self._engine_names(), what, min(timeout, _REPORT_GRACE_S))
        per_client: list[list[str]] = [[] for _ in self.clients]
        for engine, errors in zip(self.engines, reports, strict=True):
            per_client[engine.client] += errors
        return per_client

    def _close_sessions(self, pool: ThreadPoolExecutor, timeout: float) -> str:
        """Close, unlabelled, every vLLM session this rank left open (a round that failed before
        its finish); returns a note naming the servers where closing failed, or ""."""
        opened = sorted(self._open_sessions)
        finishes = [pool.submit(self.clients[i].finish_weight_update, None) for i in opened]
        failed = []
        for i, fut in zip(opened, finishes, strict=True):
            try:
                result(fut, client_name(self.clients[i]), "finish_weight_update", timeout)
                self._open_sessions.discard(i)
            except SendError as exc:
                failed.append(str(exc))
        return f"; closing the session failed: {'; '.join(failed)}" if failed else ""

    def shutdown(self) -> None:
        """Leave the transfer group and stop the KV store this rank hosts."""
        if self.adapter is not None:
            self.adapter.teardown_weight_update_group()
        if self.is_sender:
            if self._open_sessions:
                with ThreadPoolExecutor(max_workers=len(self._open_sessions)) as pool:
                    note = self._close_sessions(pool, self.info.timeout_s if self.info else 60.0)
                if note:
                    logger.warning("awex_fast: at shutdown%s", note)
            for i, c in enumerate(self.clients):
                if i in self._open_sessions:  # vLLM would refuse, and its replies would shift
                    continue
                stop = getattr(c, "shutdown_weight_transfer_engine", None)
                if stop is not None:
                    with contextlib.suppress(Exception):  # a dead server has nothing to shut down
                        stop()
        if self.server is not None:
            self.server.stop()
            self.server = None
