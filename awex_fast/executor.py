"""Runs one transfer rank's plan: pack -> send / receive -> unpack, double-buffered.

Contract (who calls what, in which order, what a failure leaves behind):

* Every rank of the transfer world builds the same plan from the same metadata, creates an
  `Executor` over its own `RankPlan`, its local tensors and the `TransferGroup`, and calls
  `handshake()` once: plan digests (and the verify setting) are compared with every peer through
  the group's rendezvous store, and a mismatch makes *both* sides raise `PlanMismatchError`
  naming the first parameter whose metadata differs.
* Each update, both sides call `run(version)` concurrently. A sender packs bucket k+1 while
  bucket k is on the wire (two staging slots per peer); buckets to different peers are in
  flight together. A receiver keeps two receives posted per peer and unpacks bucket k while
  bucket k+1 arrives. A bucket that is one contiguous op already in the wire dtype is sent from,
  or received into, the parameter's own memory. Ops whose peer is this rank copy directly.
* Every wait is bounded by ``timeout_s``. Any failure raises `TransferError` naming the peer, the
  bucket and the version, aborts the group (it must be re-formed, on a fresh port, before the
  next update), and leaves `version` unchanged: the receiver's version moves only after every
  bucket of the update landed (and, with ``verify=True``, matched its checksum).
* Staging buffers and copy programs are built once and reused by every update; they are rebuilt
  only if a local tensor's storage moved.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from awex_fast import copy as afc
from awex_fast.meta import ParameterMeta
from awex_fast.transport.base import Pending, TransferError, TransferGroup, timedelta

CHECKSUM_BYTES = 8
_SLOTS = 2  # double buffering


class PlanMismatchError(TransferError):
    """Peers planned from different metadata (or settings); names the first differing parameter."""


@dataclass(frozen=True)
class WireOp:
    """One box of a bucket, seen from this rank: ``offset``/``shape`` address this rank's local
    tensor ``name``; its bytes sit at ``byte_offset`` of the bucket in ``wire_dtype``."""

    name: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    wire_dtype: torch.dtype
    byte_offset: int

    @property
    def nbytes(self) -> int:
        """Packed bytes on the wire."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.wire_dtype.itemsize


@dataclass(frozen=True)
class WireBucket:
    """One message between this rank and ``peer``: ``role`` is "send" or "recv"; ``seq`` orders
    the buckets of one (sender, receiver) pair and is the message tag."""

    role: str
    peer: int
    seq: int
    wire_bytes: int
    ops: tuple[WireOp, ...]


@dataclass
class BucketTrace:
    """Timestamps (time.perf_counter seconds) of one bucket of one update."""

    role: str
    peer: int
    seq: int
    nbytes: int
    zero_copy: bool
    pack_start: float = 0.0
    pack_end: float = 0.0
    transfer_start: float = 0.0
    transfer_end: float = 0.0
    unpack_start: float = 0.0
    unpack_end: float = 0.0


@dataclass
class _Prepared:
    program: afc.CopyProgram | None  # None: zero-copy, or nothing to pack
    wire: torch.Tensor  # what goes on the wire (a staging slice or the parameter itself)
    checksum_at: int | None = None


def _box_view(t: torch.Tensor, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return t[index] if index else t


class Executor:
    """Executes one rank's buckets over a TransferGroup. See the module docstring for the contract.

    ``buckets``: this rank's WireBuckets (sends and receives), from `wire_buckets(rank_plan)`.
    ``tensors``: canonical name -> local tensor (plain or `to_local()` of a DTensor); boxes index
    into these, and staging lives on their device (one device per executor).
    ``staging_limit_bytes``: cap on staging memory (default 2 x the largest bucket per active
    peer); when two slots per peer do not fit, one slot per peer is used, and if even that does
    not fit, construction raises ValueError.
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
    ) -> None:
        self.group = group
        self.rank = group.rank
        self.digest = digest
        self.verify = verify
        self.timeout_s = float(timeout_s if timeout_s is not None else group.timeout_s)
        self.zero_copy = zero_copy and not verify  # the checksum trailer needs a staging slot
        self.version: int | None = None
        self.trace: list[BucketTrace] = []
        self._fingerprints = fingerprints
        self._tensors = dict(tensors)
        self._sends = [b for b in buckets if b.role == "send" and b.peer != self.rank]
        self._recvs = [b for b in buckets if b.role == "recv" and b.peer != self.rank]
        self._self_pairs = self._match_self_buckets(buckets)
        missing = {op.name for b in buckets for op in b.ops} - set(self._tensors)
        if missing:
            raise KeyError(
                f"rank {self.rank}: the plan names tensors this rank does not have: {sorted(missing)[:5]}"
            )
        self.device = self._pick_device()
        self._slots_per_peer, self._staging = self._allocate_staging(staging_limit_bytes)
        self._ptrs = self._storage_ptrs()
        self._prepare()

    # --- setup ----------------------------------------------------------------------------------

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

    def _allocate_staging(self, limit: int | None) -> tuple[int, dict[tuple[str, int], list[torch.Tensor]]]:
        need: dict[tuple[str, int], int] = {}
        for b in (*self._sends, *self._recvs):
            key = (b.role, b.peer)
            need[key] = max(need.get(key, 0), b.wire_bytes + (CHECKSUM_BYTES if self.verify else 0))
        slots = _SLOTS
        total = slots * sum(need.values())
        if limit is not None and total > limit:
            slots = 1
            total = sum(need.values())
            if total > limit:
                raise ValueError(
                    f"rank {self.rank}: staging needs at least {total} bytes (one bucket per active peer) "
                    f"but the limit is {limit}; lower bucket_bytes"
                )
        staging = {}
        for key, nbytes in need.items():
            # 16-byte multiples keep every slot aligned for vectorised copies.
            size = (nbytes + 15) // 16 * 16
            staging[key] = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(slots)]
        return slots, staging

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging memory this executor holds."""
        return sum(s.numel() for st in self._staging.values() for s in st)

    def staging_pointers(self) -> list[int]:
        """Data pointers of every staging slot (stable across updates)."""
        return [s.data_ptr() for st in self._staging.values() for s in st]

    def _storage_ptrs(self) -> dict[str, int]:
        return {n: t.data_ptr() for n, t in self._tensors.items()}

    def _direct_view(self, b: WireBucket) -> torch.Tensor | None:
        """The parameter's own memory as the wire buffer, when the bucket allows it."""
        if not self.zero_copy or len(b.ops) != 1:
            return None
        op = b.ops[0]
        view = _box_view(self._tensors[op.name], op.offset, op.shape)
        if view.dtype != op.wire_dtype or not view.is_contiguous() or op.byte_offset != 0:
            return None
        if op.nbytes != b.wire_bytes:
            return None
        return view.reshape(-1)

    def _prepare(self) -> None:
        self._prepared: dict[tuple[str, int, int], _Prepared] = {}
        for b in (*self._sends, *self._recvs):
            direct = self._direct_view(b)
            if direct is not None:
                self._prepared[(b.role, b.peer, b.seq)] = _Prepared(None, direct)
                continue
            buf = self._staging[(b.role, b.peer)][b.seq % self._slots_per_peer]
            views = [_box_view(self._tensors[op.name], op.offset, op.shape) for op in b.ops]
            offsets = [op.byte_offset for op in b.ops]
            dtypes = [op.wire_dtype for op in b.ops]
            if b.role == "send":
                program = afc.gather_program(views, buf, offsets, dtypes)
            else:
                program = afc.scatter_program(buf, offsets, dtypes, views)
            wire_len = b.wire_bytes + (CHECKSUM_BYTES if self.verify else 0)
            self._prepared[(b.role, b.peer, b.seq)] = _Prepared(
                program, buf[:wire_len], b.wire_bytes if self.verify else None
            )
        srcs, dsts = [], []
        for send, recv in self._self_pairs:
            for s_op, r_op in zip(send.ops, recv.ops, strict=True):
                srcs.append(_box_view(self._tensors[s_op.name], s_op.offset, s_op.shape))
                dsts.append(_box_view(self._tensors[r_op.name], r_op.offset, r_op.shape))
        self._self_program = afc.direct_program(srcs, dsts) if srcs else None

    # --- handshake ------------------------------------------------------------------------------

    def peers(self) -> list[int]:
        """Every other rank this rank exchanges buckets with."""
        return sorted({b.peer for b in (*self._sends, *self._recvs)})

    def handshake(self) -> None:
        """Compare plan digests and settings with every peer through the rendezvous store."""
        store = self.group.store
        mine = {"digest": self.digest, "verify": self.verify}
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

    def _raise_mismatch(self, peer: int, theirs: dict, mine: dict) -> None:
        store = self.group.store
        detail = ""
        if theirs.get("verify") != mine["verify"]:
            detail = f"verify={mine['verify']} here but verify={theirs.get('verify')} on rank {peer}"
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

    def _revalidate(self) -> None:
        if self._storage_ptrs() != self._ptrs:  # a parameter was re-allocated: rebuild programs
            self._ptrs = self._storage_ptrs()
            self._prepare()

    def run(self, version: int) -> dict:
        """Send and receive every bucket of this rank for ``version``; on success the receiver's
        `version` becomes ``version``. Returns {"bytes_sent", "bytes_received", "seconds", ...}."""
        self._revalidate()
        self.trace = []
        t0 = time.perf_counter()
        try:
            if self._self_program is not None:
                self._self_program.run()
            sent = self._run_sends(version) if self._sends else 0
            received = self._run_recvs(version) if self._recvs else 0
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except TransferError:
            self.group.abort()
            raise
        self.version = version
        return {
            "version": version,
            "bytes_sent": sent,
            "bytes_received": received,
            "buckets": len(self._sends) + len(self._recvs),
            "seconds": time.perf_counter() - t0,
            "staging_bytes": self.staging_bytes,
        }

    def _wait(self, pending: Pending, b: WireBucket, version: int) -> None:
        try:
            pending.wait(self.timeout_s)
        except (TimeoutError, RuntimeError) as exc:
            verb = "sending to" if b.role == "send" else "receiving from"
            raise TransferError(
                f"rank {self.rank} failed {verb} its peer: {exc}", peer=b.peer, bucket=b.seq, version=version
            ) from exc

    def _run_sends(self, version: int) -> int:
        by_peer = _rounds(self._sends)
        inflight: dict[int, deque[tuple[Pending, WireBucket, BucketTrace]]] = {p: deque() for p in by_peer}
        sent = 0
        for b in _round_robin(by_peer):
            q = inflight[b.peer]
            if len(q) == self._slots_per_peer:  # the slot this bucket reuses must be free
                self._finish_send(q.popleft(), version)
            prep = self._prepared[("send", b.peer, b.seq)]
            tr = BucketTrace("send", b.peer, b.seq, b.wire_bytes, prep.program is None)
            tr.pack_start = time.perf_counter()
            if prep.program is not None:
                prep.program.run()
            if prep.checksum_at is not None:
                _write_checksum(prep.wire, prep.checksum_at)
            tr.pack_end = tr.transfer_start = time.perf_counter()
            try:
                pending = self.group.isend(prep.wire, b.peer, b.seq)
            except RuntimeError as exc:
                raise TransferError(
                    f"rank {self.rank} could not send: {exc}", peer=b.peer, bucket=b.seq, version=version
                ) from exc
            q.append((pending, b, tr))
            sent += b.wire_bytes
        for q in inflight.values():
            while q:
                self._finish_send(q.popleft(), version)
        return sent

    def _finish_send(self, item: tuple[Pending, WireBucket, BucketTrace], version: int) -> None:
        pending, b, tr = item
        self._wait(pending, b, version)
        tr.transfer_end = time.perf_counter()
        self.trace.append(tr)

    def _post_recv(self, b: WireBucket, version: int) -> tuple[Pending, WireBucket, BucketTrace]:
        prep = self._prepared[("recv", b.peer, b.seq)]
        tr = BucketTrace("recv", b.peer, b.seq, b.wire_bytes, prep.program is None)
        tr.transfer_start = time.perf_counter()
        try:
            return self.group.irecv(prep.wire, b.peer, b.seq), b, tr
        except RuntimeError as exc:
            raise TransferError(
                f"rank {self.rank} could not post a receive: {exc}",
                peer=b.peer,
                bucket=b.seq,
                version=version,
            ) from exc

    def _run_recvs(self, version: int) -> int:
        by_peer = _rounds(self._recvs)
        upcoming = {p: deque(bs) for p, bs in by_peer.items()}
        inflight: dict[int, deque] = {p: deque() for p in by_peer}
        for p, q in upcoming.items():
            for _ in range(min(self._slots_per_peer, len(q))):
                inflight[p].append(self._post_recv(q.popleft(), version))
        received = 0
        for b in _round_robin(by_peer):
            pending, posted, tr = inflight[b.peer].popleft()
            assert posted is b
            self._wait(pending, b, version)
            tr.transfer_end = tr.unpack_start = time.perf_counter()
            prep = self._prepared[("recv", b.peer, b.seq)]
            join = getattr(self.group, "join_current_stream", None)
            if join is not None:
                join()
            if prep.checksum_at is not None:
                _check_checksum(prep.wire, prep.checksum_at, b, self.rank, version)
            if prep.program is not None:
                prep.program.run()
            tr.unpack_end = time.perf_counter()
            self.trace.append(tr)
            received += b.wire_bytes
            if upcoming[b.peer]:  # the slot just unpacked takes the next receive
                inflight[b.peer].append(self._post_recv(upcoming[b.peer].popleft(), version))
        return received


def _rounds(buckets: Iterable[WireBucket]) -> dict[int, list[WireBucket]]:
    out: dict[int, list[WireBucket]] = {}
    for b in buckets:
        out.setdefault(b.peer, []).append(b)
    for bs in out.values():
        bs.sort(key=lambda b: b.seq)
    return dict(sorted(out.items()))


def _round_robin(by_peer: Mapping[int, list[WireBucket]]) -> list[WireBucket]:
    """Bucket k of every peer before bucket k+1 of any: all peers stay in flight together."""
    order, k = [], 0
    longest = max((len(bs) for bs in by_peer.values()), default=0)
    while k < longest:
        order.extend(bs[k] for bs in by_peer.values() if k < len(bs))
        k += 1
    return order


def _write_checksum(wire: torch.Tensor, at: int) -> None:
    value = afc.checksum(wire, at)
    signed = value - (1 << 64) if value >= 1 << 63 else value  # int64 two's complement of the u64
    wire[at : at + CHECKSUM_BYTES].copy_(torch.tensor([signed], dtype=torch.int64).view(torch.uint8))


def _check_checksum(wire: torch.Tensor, at: int, b: WireBucket, rank: int, version: int) -> None:
    want = int(wire[at : at + CHECKSUM_BYTES].cpu().view(torch.int64).item()) & ((1 << 64) - 1)
    got = afc.checksum(wire, at)
    if got != want:
        raise TransferError(
            f"rank {rank}: checksum mismatch ({got:#x} != sent {want:#x})",
            peer=b.peer,
            bucket=b.seq,
            version=version,
        )


def _first_difference(mine: list[list[str]], theirs: list[list[str]], peer: int) -> str:
    a, b = dict(map(tuple, mine)), dict(map(tuple, theirs))
    for name in sorted(set(a) | set(b)):
        if name not in b:
            return f"parameter {name!r} exists here but not on rank {peer}"
        if name not in a:
            return f"parameter {name!r} exists on rank {peer} but not here"
        if a[name] != b[name]:
            return f"first differing parameter: {name!r}"
    return "parameter metadata is identical; bucket size or planner version differ"


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


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a dtype name of the metadata ("bfloat16", "float8_e4m3fn", ...)."""
    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"unknown dtype name {name!r}")


def wire_buckets(rank_plan: object) -> list[WireBucket]:
    """This rank's buckets as the executor consumes them, read from the RankPlan's raw op and
    bucket arrays in one pass (sends address the sender's local boxes, receives the receiver's)."""
    from awex_fast import plan as P

    ops, names, nd_max = rank_plan.ops.tolist(), rank_plan.names, rank_plan.max_ndim
    dtypes = [torch_dtype(n) if hasattr(torch, n) else None for n in P.DTYPES]
    b0 = P.OP_BOXES
    out = []
    for kind, peer, seq, begin, count, nbytes, _payload in rank_plan.buckets.tolist():
        send = kind == P.SEND
        wire_ops = []
        for row in ops[begin : begin + count]:
            nd = row[P.OP_NDIM]
            at = b0 if send else b0 + nd_max
            wire_ops.append(
                WireOp(
                    names[row[P.OP_PARAM]],
                    tuple(row[at : at + nd]),
                    tuple(row[b0 + 2 * nd_max : b0 + 2 * nd_max + nd]),
                    dtypes[row[P.OP_DST_DTYPE]],
                    row[P.OP_BYTE_OFFSET],
                )
            )
        out.append(WireBucket("send" if send else "recv", peer, seq, nbytes, tuple(wire_ops)))
    return out
