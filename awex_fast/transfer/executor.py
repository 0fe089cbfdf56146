"""Runs one transfer rank's plan: pack -> send / receive -> unpack, double-buffered.

Contract (who calls what, in which order, what a failure leaves behind):

* Every rank of the transfer world builds the same plan from the same metadata, creates an
  `Executor` over its own `RankPlan`, its local tensors and the `TransferGroup`, and calls
  `handshake()` once: plan digests (and the verify and message settings) are compared with every
  peer through the group's rendezvous store, and a mismatch makes *both* sides raise `PlanMismatchError`
  naming the first parameter whose metadata differs.
* Each update, both sides call `run(version)` concurrently. Every planned bucket is cut into
  messages (awex_fast.transfer.wire): an op of at least ``solo_bytes`` travels alone, in chunks of at
  most ``message_bytes``, and is sent from / received into the parameter's own memory when that
  side's box is contiguous in the wire dtype; smaller ops are grouped into staged messages. A
  sender packs staged message k+1 while message k is on the wire (``slots`` staging slots per
  peer); a receiver keeps up to ``window`` messages posted per peer (default: every one that
  needs no slot, plus one per free slot) and unpacks staged message k while later ones arrive;
  all peers are served round-robin, both sides in tag order (NCCL matches in issue
  order). Ops whose peer is this rank copy directly. That is the staged strategy
  (awex_fast.transfer.staged); over a group that declares shared slots (ipc) messages are packed
  straight into the receiver's slots instead (awex_fast.transfer.shared_slots). The group's
  declared ``strategy`` picks one; both share awex_fast.transfer.exchange.
* Every wait is bounded by ``timeout_s``. Any failure raises `TransferError` naming the peer, the
  bucket and the version, aborts the group (it must be re-formed, on a fresh port, before the
  next update), and leaves `version` unchanged: the receiver's version moves only after every
  bucket of the update landed (and, with ``verify=True``, matched its checksum).
* Staging buffers and copy programs are built once and reused by every update; they are rebuilt
  (and which messages go zero-copy is decided again) only if a local tensor's storage moved.
* ``verify=True``: both sides compute a native checksum of every message; after the last
  message each sender sends its peer the list, and the receiver compares before it takes the
  version (zero-copy stays on).
* A failing rank records its error in the group's rendezvous store (the first one recorded
  wins), and every other failing rank appends that first failure to its own error, so a rank
  whose peer merely aborted still learns which rank failed first and why (best effort: the
  store lives in transfer rank 0's process).
* The round's outcome: after its last message every receiver sends each of its senders
  ``[version, landed]`` (one 16-byte message per pair), and a sender's `run` returns only once
  all its receivers said the version landed. A receiver that fails (a checksum mismatch, a dead
  peer) tells the senders still listening that it did not; either way no sender reports success
  for a version that did not fully arrive.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

import torch

from awex_fast.meta import ParameterMeta
from awex_fast.transfer import boxcopy as afc
from awex_fast.transfer import shared_slots, staged
from awex_fast.transfer.exchange import Exchange, MessageStrategy, MessageTrace, box_view
from awex_fast.transfer.wire import (
    WireBucket,
    WireOp,
    messages_by_peer,
    torch_dtype,
    wire_buckets,
)
from awex_fast.transport.base import (
    SHARED_SLOTS,
    STRATEGIES,
    SharedSlotGroup,
    TransferError,
    TransferGroup,
    timedelta,
)

__all__ = [
    "Executor",
    "MessageTrace",
    "PlanMismatchError",
    "WireBucket",
    "WireOp",
    "check_local_tensors",
    "first_fingerprint_difference",
    "metadata_fingerprints",
    "torch_dtype",
    "wire_buckets",
]

_WINDOW: int | None = None  # messages posted ahead per peer (None: all; zero-copy needs no slot)


class PlanMismatchError(TransferError):
    """Peers planned from different metadata (or settings); names the first differing parameter."""


class Executor:
    """Executes one rank's buckets over a TransferGroup. See the module docstring for the contract.

    ``buckets``: this rank's WireBuckets (sends and receives), from `wire_buckets(rank_plan)`.
    ``tensors``: canonical name -> local tensor (plain or `to_local()` of a DTensor); boxes index
    into these, and staging lives on their device (one device per executor).
    ``message_bytes`` / ``solo_bytes``: how buckets are cut into messages (awex_fast.transfer.wire); both
    sides must use the same values (the handshake checks).
    The group's declared ``strategy`` picks how messages move: `STAGED` (awex_fast.transfer.staged;
    ``slots`` staging slots per peer, default 2, zero-copy where a box allows) or `SHARED_SLOTS`
    (awex_fast.transfer.shared_slots, the ``ipc`` backend): nothing is staged by this executor,
    each message is packed straight into the receiver's shared slot (``slots`` per pair, default
    4, each as large as the pair's largest message) and unpacked straight out of it, and
    ``message_bytes`` defaults to 4 MiB.
    ``staging_limit_bytes`` (staged): cap on staging memory (default ``slots`` x the largest
    staged message per active peer); when that does not fit, fewer slots per peer are used, down
    to one, and if even one does not fit, construction raises ValueError.
    """

    def __init__(
        self,
        buckets: Sequence[WireBucket],
        tensors: Mapping[str, torch.Tensor],
        group: TransferGroup,
        *,
        digest: str = "",
        verify: bool = False,
        timeout_s: float | None = None,
        staging_limit_bytes: int | None = None,
        zero_copy: bool = True,
        fingerprints: Callable[[], list[tuple[str, str]]] | None = None,
        message_bytes: int | None = None,
        solo_bytes: int | None = None,
        slots: int | None = None,
        window: int | None = _WINDOW,
    ) -> None:
        if group.strategy not in STRATEGIES:
            raise ValueError(
                f"transfer group ({group.backend}) declares strategy {group.strategy!r}; "
                f"expected one of {', '.join(STRATEGIES)}"
            )
        self.group = group
        self.rank = group.rank
        self.digest = digest
        self.verify = verify
        self.timeout_s = float(timeout_s if timeout_s is not None else group.timeout_s)
        self.shared = group.strategy == SHARED_SLOTS
        self.zero_copy = zero_copy and not self.shared
        if message_bytes is None:
            message_bytes = shared_slots.MESSAGE_BYTES if self.shared else staged.MESSAGE_BYTES
        if solo_bytes is None:  # shared slots: nothing is zero-copy, so ops are only cut to fit a slot
            solo_bytes = message_bytes if self.shared else staged.SOLO_BYTES
        if slots is None:
            slots = shared_slots.SLOTS if self.shared else staged.SLOTS
        self.message_bytes, self.solo_bytes = int(message_bytes), int(solo_bytes)
        self.window = max(1, int(window)) if window is not None else 1 << 62
        self.version: int | None = None
        self._fingerprints = fingerprints
        self._tensors = dict(tensors)
        self._self_pairs = self._match_self_buckets(buckets)
        missing = {op.name for b in buckets for op in b.ops} - set(self._tensors)
        if missing:
            raise KeyError(
                f"rank {self.rank}: the plan names tensors this rank does not have: {sorted(missing)[:5]}"
            )
        check_local_tensors(buckets, self._tensors, self.rank)
        self._buckets = tuple(buckets)
        self._exchange = self._make_exchange(buckets)
        self.device = self._exchange.device
        self.strategy: MessageStrategy = self._make_strategy(max(1, int(slots)), staging_limit_bytes)
        self._tensor_list = list(self._tensors.values())
        self._prepare()

    # --- setup ----------------------------------------------------------------------------------

    def _make_exchange(self, buckets: Sequence[WireBucket]) -> Exchange:
        """This rank's messages per remote pair, cut from its buckets (awex_fast.transfer.wire)."""
        remote = [b for b in buckets if b.peer != self.rank]
        sends = messages_by_peer((b for b in remote if b.role == "send"), self.message_bytes, self.solo_bytes)
        recvs = messages_by_peer((b for b in remote if b.role == "recv"), self.message_bytes, self.solo_bytes)
        return Exchange(self.group, self.timeout_s, self.verify, self.window, self._tensors, sends, recvs,
                        self._pick_device())

    def _make_strategy(self, slots: int, staging_limit_bytes: int | None) -> MessageStrategy:
        """The strategy the group declares (`TransferGroup.strategy`)."""
        if self.group.strategy == SHARED_SLOTS:
            group = cast(SharedSlotGroup, self.group)  # what its declared strategy promises
            return shared_slots.SharedSlotMessages(self._exchange, group, slots=slots)
        return staged.StagedMessages(
            self._exchange, slots=slots, zero_copy=self.zero_copy, staging_limit_bytes=staging_limit_bytes
        )

    def _pick_device(self) -> torch.device:
        devices = {t.device for t in self._tensors.values()}
        if len(devices) > 1:
            raise ValueError(
                f"rank {self.rank}: local tensors live on several devices: {sorted(map(str, devices))}"
            )
        return devices.pop() if devices else torch.device("cpu")

    def _match_self_buckets(self, buckets: Sequence[WireBucket]) -> list[tuple[WireBucket, WireBucket]]:
        sends = {b.seq: b for b in buckets if b.role == "send" and b.peer == self.rank}
        recvs = {b.seq: b for b in buckets if b.role == "recv" and b.peer == self.rank}
        if sends.keys() != recvs.keys():
            raise ValueError(
                f"rank {self.rank}: self-send buckets {sorted(sends)} and receives {sorted(recvs)} differ"
            )
        return [(sends[k], recvs[k]) for k in sorted(sends)]

    @property
    def trace(self) -> list[MessageTrace]:
        """Timestamps of every message of the last update."""
        return self._exchange.trace

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging memory this executor holds (shared slots: the receiving channels')."""
        return sum(s.numel() for st in self.strategy.staging.values() for s in st)

    def staging_pointers(self) -> list[int]:
        """Data pointers of every staging slot (stable across updates)."""
        return [s.data_ptr() for st in self.strategy.staging.values() for s in st]

    def zero_copy_fraction(self) -> float:
        """Share of this rank's message bytes sent from / received into parameter memory."""
        total = zc = 0
        for prepared in self.strategy.prepared.values():
            for p in prepared:
                total += p.msg.nbytes
                zc += p.msg.nbytes if p.program is None else 0
        return zc / total if total else 0.0

    def _storage_ptrs(self) -> list[int]:
        # one pass of a C method over a fixed tensor list: an MoE rank holds thousands of tensors
        return list(map(torch.Tensor.data_ptr, self._tensor_list))

    def _prepare(self) -> None:
        """The self-copy program, then the strategy's programs (and staging)."""
        srcs, dsts = [], []
        for send, recv in self._self_pairs:
            for s_op, r_op in zip(send.ops, recv.ops, strict=True):
                srcs.append(box_view(self._tensors[s_op.name], s_op.offset, s_op.shape))
                dsts.append(box_view(self._tensors[r_op.name], r_op.offset, r_op.shape))
        self._self_program = afc.direct_program(srcs, dsts) if srcs else None
        self.strategy.prepare()
        self._ptrs, self._built_for = self._storage_ptrs(), self._geometry()

    def _open(self) -> None:
        """The strategy's connections (shared slots: the channels); a failure aborts the group."""
        try:
            self.strategy.open()
        except TransferError:
            self.group.abort()
            raise

    # --- handshake ------------------------------------------------------------------------------

    def peers(self) -> list[int]:
        """Every other rank this rank exchanges messages with."""
        return sorted({*self._exchange.sends, *self._exchange.recvs})

    def send_bytes_by_peer(self) -> dict[int, int]:
        """Bytes this rank sends each remote peer per update (its plan's messages)."""
        return {peer: sum(m.nbytes for m in msgs) for peer, msgs in self._exchange.sends.items()}

    def _settings(self) -> dict:
        return {
            "digest": self.digest,
            "verify": self.verify,
            "message_bytes": self.message_bytes,
            "solo_bytes": self.solo_bytes,
            "shared": self.shared,
        }

    def handshake(self) -> None:
        """Compare plan digests and settings with every peer through the rendezvous store, then
        open the strategy's connections, so that a dead peer shows before the first update."""
        store = self.group.store
        mine = self._settings()
        store.set(f"plan_digest_rank{self.rank}", json.dumps(mine))
        for peer in self.peers():
            key = f"plan_digest_rank{peer}"
            try:
                store.wait([key], timedelta(self.timeout_s))
            except RuntimeError as exc:
                self.group.abort()
                raise TransferError("peer never published its plan digest", peer=peer) from exc
            theirs = json.loads(store.get(key))
            if theirs != mine:
                self._raise_mismatch(peer, theirs, mine)
        self._open()

    def _raise_mismatch(self, peer: int, theirs: dict, mine: dict) -> None:
        store = self.group.store
        detail = ""
        settings = [k for k in mine if k != "digest" and theirs.get(k) != mine[k]]
        if settings:
            detail = ", ".join(f"{k}={mine[k]} here but {theirs.get(k)} on rank {peer}" for k in settings)
        elif self._fingerprints is not None:
            store.set(f"plan_params_rank{self.rank}", json.dumps(self._fingerprints()))
            key = f"plan_params_rank{peer}"
            try:
                store.wait([key], timedelta(self.timeout_s))
                detail = _first_difference(self._fingerprints(), json.loads(store.get(key)), peer)
            except RuntimeError:
                detail = "the peer did not publish its parameter list"
        self.group.abort()
        raise PlanMismatchError(
            f"rank {self.rank} and rank {peer} planned from different metadata "
            f"(digest {mine['digest']} vs {theirs.get('digest')}): {detail or 'settings differ'}",
            peer=peer,
        )

    # --- one update -----------------------------------------------------------------------------

    def _failed(self, version: int, exc: TransferError, *, tell_senders: bool) -> TransferError:
        """Wind down a failed round and return the error to raise: record ``exc`` in the group's
        store (or learn the round's first failure from it), tell the senders still listening that
        ``version`` did not land here (``tell_senders``: before the outcome exchange; best
        effort), and abort the group."""
        first = _record_failure(self.group.store, self.rank, version, exc)
        if tell_senders:
            with contextlib.suppress(TransferError):
                self._exchange.tell_senders(version, landed=False, timeout_s=min(self.timeout_s, 5.0))
        self.group.abort()
        if first is None:
            return exc
        return exc.with_detail(f"{exc.detail} [the round's first failure: {first}]")

    def _revalidate(self) -> None:
        if self._storage_ptrs() != self._ptrs:  # a parameter was re-allocated: rebuild programs
            self._prepare()

    def rebind(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Address ``tensors`` (canonical name -> local tensor, at least every name the plan
        uses) from now on, instead of the tensors held so far; returns whether the copy programs
        were rebuilt.

        Why: a source may hand out *new* tensors between rounds (a dict of the next step's
        tensors, ``load_state_dict(assign=True)``, a re-published checkpoint). The executor must
        send what the source holds now, never the tensors it was given at construction. Every
        tensor is checked against the plan first (extent, receive dtype, device), before anything
        is replaced; the programs are rebuilt unless every tensor has the geometry (address,
        shape, strides, dtype) the programs were built for. Holding the new tensors keeps their
        memory alive, so an equal geometry addresses exactly the memory the caller gave."""
        names = list(self._tensors)
        missing = [n for n in names if n not in tensors]
        if missing:
            raise KeyError(f"rank {self.rank}: the plan names tensors the source no longer has: "
                           f"{missing[:5]}")
        new = {n: tensors[n] for n in names}
        check_local_tensors(self._buckets, new, self.rank)
        devices = {t.device for t in new.values()}
        if devices and devices != {self.device}:
            moved = sorted(n for n, t in new.items() if t.device != self.device)
            raise ValueError(f"rank {self.rank}: tensors {moved[:5]} moved from {self.device} to "
                             f"{sorted(map(str, devices - {self.device}))}; the transfer group serves "
                             "one device")
        self._tensors.update(new)  # in place: the exchange addresses the same dict
        self._tensor_list = list(self._tensors.values())
        if self._storage_ptrs() == self._ptrs and self._geometry() == self._built_for:
            return False
        self._prepare()
        return True

    def _geometry(self) -> list[tuple]:
        """What the copy programs bake in, per tensor: address, dtype, shape, strides."""
        return [(t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in self._tensor_list]

    def run(self, version: int, tensors: Mapping[str, torch.Tensor] | None = None) -> dict:
        """Send and receive every message of this rank for ``version``; on success the receiver's
        `version` becomes ``version``. ``tensors``: the source's tensors of this round (see
        `rebind`); a mismatch with the plan fails the round before a byte moves. Returns
        {"bytes_sent", "bytes_received", "seconds", "rebound", ...}."""
        self._open()
        rebound = False
        if tensors is None:
            self._revalidate()
        else:
            try:
                rebound = self.rebind(tensors)
            except (KeyError, ValueError) as exc:
                err = TransferError(f"rank {self.rank}: this round's tensors do not match the plan: {exc}",
                                    version=version)
                raise self._failed(version, err, tell_senders=True) from exc
        self._exchange.trace = []
        t0 = time.perf_counter()
        try:
            if self._self_program is not None:
                self._self_program.run()
            sent, received = self.strategy.run(version)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except TransferError as exc:
            err = self._failed(version, exc, tell_senders=True)
            if err is exc:
                raise
            raise err from exc
        try:  # every receiver tells its senders the round landed, so no sender reports a false success
            self._exchange.tell_senders(version, landed=True)
            # a receiver may spend a whole timeout finding that another of its senders is dead
            # before it can answer: listen that long and then some
            self._exchange.hear_receivers(version, 2 * self.timeout_s + 5.0)
        except TransferError as exc:
            err = self._failed(version, exc, tell_senders=False)
            if err is exc:
                raise
            raise err from exc
        self.version = version
        return {
            "version": version,
            "bytes_sent": sent,
            "bytes_received": received,
            "messages": sum(len(m) for _, m in self._exchange.all_pairs()),
            "seconds": time.perf_counter() - t0,
            "staging_bytes": self.staging_bytes,
            "rebound": rebound,
        }


def _record_failure(store: object, rank: int, version: int, exc: TransferError) -> str | None:
    """Record ``exc`` as this rank's failure of ``version`` in the group's rendezvous store (the
    first rank to record wins) and return the first failure another rank recorded, if any.

    Why: a rank only sees its own peers; when rank X dies, a rank that never talked to X learns
    only that its own peer aborted. The first failure recorded names X (and what failed there).
    Best effort: the store lives in transfer rank 0's process, and a dead rank 0 takes it along.
    """
    # Bounded by a thread: a store behind a link that went down does not fail its calls, it
    # hangs in them (TCP retransmits for minutes), and a failing round must still end.
    found: list[str | None] = []
    worker = threading.Thread(target=lambda: found.append(_exchange_failure(store, rank, version, exc)),
                              daemon=True, name="awex-record-failure")
    worker.start()
    worker.join(_RECORD_FAILURE_S)
    return found[0] if found else None


_RECORD_FAILURE_S = 5.0


def _exchange_failure(store: object, rank: int, version: int, exc: TransferError) -> str | None:
    """`_record_failure`'s store calls."""
    key = f"round_failure/v{version}"
    try:
        if store.add(f"{key}/count", 1) == 1:  # type: ignore[attr-defined]
            store.set(key, f"rank {rank}: {exc}")  # type: ignore[attr-defined]
            return None
        store.wait([key], timedelta(2.0))  # type: ignore[attr-defined]
        first = store.get(key).decode()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - the store went away with its host: nothing to add
        return None
    return None if first.startswith(f"rank {rank}: ") else first


def check_local_tensors(
    buckets: Iterable[WireBucket], tensors: Mapping[str, torch.Tensor], rank: int
) -> None:
    """Raise ValueError, before any byte moves, unless every local tensor holds every box the
    plan addresses in it (same number of dims, at least the extent the boxes need) and, on the
    receiving side, has the dtype the metadata promised (the wire carries the receiver's dtype).
    A tensor too small was sliced short without a word (wrong elements, or a gloo abort)."""
    need: dict[str, list[int]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for b in buckets:
        for op in b.ops:
            ends = need.get(op.name)
            if ends is None:
                ends = need[op.name] = [0] * len(op.shape)
            if len(ends) == len(op.shape):
                ends[:] = map(max, ends, map(int.__add__, op.offset, op.shape))
            if b.role == "recv":
                dtypes[op.name] = op.wire_dtype
    for name, ends in need.items():
        t = tensors[name]
        want = dtypes.get(name)
        short = t.dim() != len(ends) or any(map(int.__lt__, t.shape, ends))
        if short or (want is not None and t.dtype != want):
            dtype = f" {str(want).removeprefix('torch.')}" if want is not None else ""
            raise ValueError(
                f"rank {rank}: parameter {name!r}: the plan needs a local{dtype} tensor of at least shape "
                f"{tuple(ends)}, but this rank's is {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            )


def first_fingerprint_difference(mine: Iterable[Sequence[str]],
                                 theirs: Iterable[Sequence[str]]) -> tuple[str, str] | None:
    """The first key (sorted) where two `metadata_fingerprints` lists differ, and how: "gone"
    (only in ``mine``), "new" (only in ``theirs``) or "changed"; None when they are equal."""
    a, b = dict(map(tuple, mine)), dict(map(tuple, theirs))
    for key in sorted(set(a) | set(b)):
        if key not in b:
            return key, "gone"
        if key not in a:
            return key, "new"
        if a[key] != b[key]:
            return key, "changed"
    return None


def _first_difference(mine: list[list[str]], theirs: list[list[str]], peer: int) -> str:
    found = first_fingerprint_difference(mine, theirs)
    if found is None:
        return "parameter metadata is identical; bucket size or planner version differ"
    name, how = found
    return {"gone": f"parameter {name!r} exists here but not on rank {peer}",
            "new": f"parameter {name!r} exists on rank {peer} but not here",
            "changed": f"first differing parameter: {name!r}"}[how]


def metadata_fingerprints(sides: Iterable[tuple[str, Iterable[ParameterMeta]]]) -> list[tuple[str, str]]:
    """(side:name, short hash of its canonical metadata) per parameter, sorted; compared between
    peers only after their digests disagree, to name the first differing parameter."""
    out = []
    for side, group in sides:
        for m in group:
            pieces = sorted((p.rank, p.global_offset, p.shape, p.local) for p in m.pieces())
            text = json.dumps([list(m.global_shape), m.dtype, pieces])
            out.append((f"{side}:{m.name}", hashlib.sha1(text.encode()).hexdigest()[:16]))
    return sorted(out)
