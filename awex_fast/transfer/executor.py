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
  order). Ops whose peer is this rank copy directly.
* Every wait is bounded by ``timeout_s``. Any failure raises `TransferError` naming the peer, the
  bucket and the version, aborts the group (it must be re-formed, on a fresh port, before the
  next update), and leaves `version` unchanged: the receiver's version moves only after every
  bucket of the update landed (and, with ``verify=True``, matched its checksum).
* Staging buffers and copy programs are built once and reused by every update; they are rebuilt
  (and which messages go zero-copy is decided again) only if a local tensor's storage moved.
* ``verify=True``: both sides compute a native checksum of every message; after the last
  message each sender sends its peer the list, and the receiver compares before it takes the
  version (zero-copy stays on).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from awex_fast.meta import ParameterMeta
from awex_fast.transfer import boxcopy as afc
from awex_fast.transfer.wire import (
    WireBucket,
    WireMessage,
    WireOp,
    messages_by_peer,
    torch_dtype,
    wire_buckets,
)
from awex_fast.transport.base import Pending, TransferError, TransferGroup, timedelta

__all__ = [
    "Executor",
    "MessageTrace",
    "PlanMismatchError",
    "WireBucket",
    "WireOp",
    "check_local_tensors",
    "metadata_fingerprints",
    "torch_dtype",
    "wire_buckets",
]

_SLOTS = 2  # staging slots per peer: staged message k+1 is packed while k is on the wire
_WINDOW: int | None = None  # messages posted ahead per peer (None: all; zero-copy needs no slot)
MESSAGE_BYTES = 32 << 20
SOLO_BYTES = 256 << 10
# Over a group with shared slots (ipc) every message is packed into the receiver's slot and
# unpacked from it: nothing is zero-copy, so ops are only cut to fit a slot, and small messages
# keep the slots cache-sized; more slots let a sender run further ahead of a busy receiver.
SHARED_MESSAGE_BYTES = 4 << 20
SHARED_SLOTS = 4
_MISMATCH = 5  # the native runner's status for "the peer published another message"


class PlanMismatchError(TransferError):
    """Peers planned from different metadata (or settings); names the first differing parameter."""


@dataclass
class MessageTrace:
    """Timestamps (time.perf_counter seconds) of one message of one update."""

    role: str
    peer: int
    seq: int  # the message tag (its index among the pair's messages)
    bucket: int  # the planner bucket it was cut from
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
    """One message made ready: its wire tensor and, when staged, the copy program and slot."""

    msg: WireMessage
    wire: torch.Tensor  # bytes on the wire: a staging slot's prefix or the parameter's own memory
    program: afc.CopyProgram | None  # None: zero-copy
    slot: int | None  # staging slot index (None: zero-copy)


_InFlight = tuple[Pending, _Prepared, MessageTrace]


def _box_view(t: torch.Tensor, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return t[index] if index else t


class Executor:
    """Executes one rank's buckets over a TransferGroup. See the module docstring for the contract.

    ``buckets``: this rank's WireBuckets (sends and receives), from `wire_buckets(rank_plan)`.
    ``tensors``: canonical name -> local tensor (plain or `to_local()` of a DTensor); boxes index
    into these, and staging lives on their device (one device per executor).
    ``message_bytes`` / ``solo_bytes``: how buckets are cut into messages (awex_fast.transfer.wire); both
    sides must use the same values (the handshake checks).
    Over a group with shared slots (the ``ipc`` backend) nothing is staged by this executor:
    each message is packed straight into the receiver's shared slot (``slots`` per pair, default
    4, each as large as the pair's largest message) and unpacked straight out of it, and
    ``message_bytes`` defaults to 4 MiB.
    ``staging_limit_bytes``: cap on staging memory (default ``slots`` x the largest staged message
    per active peer); when that does not fit, fewer slots per peer are used, down to one, and if
    even one does not fit, construction raises ValueError.
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
        self.group = group
        self.rank = group.rank
        self.digest = digest
        self.verify = verify
        self.timeout_s = float(timeout_s if timeout_s is not None else group.timeout_s)
        # A group that offers shared slots (awex_fast.transport.ipc) is written into directly.
        self.shared = callable(getattr(group, "channel", None))
        self.zero_copy = zero_copy and not self.shared
        if message_bytes is None:
            message_bytes = SHARED_MESSAGE_BYTES if self.shared else MESSAGE_BYTES
        if solo_bytes is None:
            solo_bytes = message_bytes if self.shared else SOLO_BYTES
        if slots is None:
            slots = SHARED_SLOTS if self.shared else _SLOTS
        self.message_bytes, self.solo_bytes = int(message_bytes), int(solo_bytes)
        self.window = max(1, int(window)) if window is not None else 1 << 62
        self.version: int | None = None
        self.trace: list[MessageTrace] = []
        self._fingerprints = fingerprints
        self._tensors = dict(tensors)
        self._self_pairs = self._match_self_buckets(buckets)
        missing = {op.name for b in buckets for op in b.ops} - set(self._tensors)
        if missing:
            raise KeyError(
                f"rank {self.rank}: the plan names tensors this rank does not have: {sorted(missing)[:5]}"
            )
        check_local_tensors(buckets, self._tensors, self.rank)
        remote = [b for b in buckets if b.peer != self.rank]
        self._sends = messages_by_peer(
            (b for b in remote if b.role == "send"), self.message_bytes, self.solo_bytes
        )
        self._recvs = messages_by_peer(
            (b for b in remote if b.role == "recv"), self.message_bytes, self.solo_bytes
        )
        self.device = self._pick_device()
        self._slots, self._staging_limit = max(1, int(slots)), staging_limit_bytes
        self._sums = {  # per-message checksums exchanged at the end of an update
            key: torch.empty(len(msgs), dtype=torch.int64, device=self.device)
            for key, msgs in self._all_pairs()
            if verify
        }
        self._ptrs = self._storage_ptrs()
        self._channels: dict[tuple[str, int], object] = {}  # shared mode: the pair's channel
        self._chunk_base: dict[tuple[str, int], int] = {}  # shared mode: chunk number of tag 0
        self._prepared: dict[tuple[str, int], list[_Prepared]] = {}
        self._staging: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._slots_per_peer = self._slots
        self._prepare()

    # --- setup ----------------------------------------------------------------------------------

    def _all_pairs(self) -> list[tuple[tuple[str, int], list[WireMessage]]]:
        return [(("send", p), m) for p, m in self._sends.items()] + [
            (("recv", p), m) for p, m in self._recvs.items()
        ]

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

    def _direct_view(self, m: WireMessage) -> torch.Tensor | None:
        """The parameter's own memory as the message's wire bytes, when the message allows it."""
        if not self.zero_copy or not m.solo:
            return None
        op = m.ops[0]
        view = _box_view(self._tensors[op.name], op.offset, op.shape)
        if view.dtype != op.wire_dtype or not view.is_contiguous() or op.nbytes != m.nbytes:
            return None
        return view.reshape(-1)

    def _allocate_staging(
        self, direct: Mapping[tuple[str, int], list[torch.Tensor | None]]
    ) -> tuple[int, dict[tuple[str, int], list[torch.Tensor]]]:
        """Slots per peer and the staging slots of every pair with a staged message (``direct``:
        each pair's messages' zero-copy views, None where the message is staged)."""
        need: dict[tuple[str, int], int] = {}
        for key, msgs in self._all_pairs():
            staged = [m.nbytes for m, view in zip(msgs, direct[key], strict=True) if view is None]
            if staged:
                need[key] = max(staged)
        slots, limit = self._slots, self._staging_limit
        per_slot = sum(need.values())
        if limit is not None and slots * per_slot > limit:
            slots = limit // per_slot if per_slot else slots
            if slots < 1:
                raise ValueError(
                    f"rank {self.rank}: staging needs at least {per_slot} bytes (one message per active "
                    f"peer) but the limit is {limit}; lower message_bytes"
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

    def zero_copy_fraction(self) -> float:
        """Share of this rank's message bytes sent from / received into parameter memory."""
        total = zc = 0
        for prepared in self._prepared.values():
            for p in prepared:
                total += p.msg.nbytes
                zc += p.msg.nbytes if p.program is None else 0
        return zc / total if total else 0.0

    def _storage_ptrs(self) -> dict[str, int]:
        return {n: t.data_ptr() for n, t in self._tensors.items()}

    def _prepare(self) -> None:
        """Decide zero-copy per message, allocate staging for the rest, build the copy programs
        (shared mode: the programs write into / read from the channels' slots, once they exist)."""
        if self.shared:
            self._prepare_self()
            if self._channels:
                self._prepare_shared()
            return
        direct = {key: [self._direct_view(m) for m in msgs] for key, msgs in self._all_pairs()}
        self._slots_per_peer, self._staging = self._allocate_staging(direct)
        self._prepared = {}
        for (role, peer), msgs in self._all_pairs():
            out, staged = [], 0
            for m, view in zip(msgs, direct[(role, peer)], strict=True):
                if view is not None:
                    out.append(_Prepared(m, view, None, None))
                    continue
                slot = staged % self._slots_per_peer
                staged += 1
                out.append(self._staged(role, m, self._staging[(role, peer)][slot], slot))
            self._prepared[(role, peer)] = out
        self._prepare_self()

    def _staged(self, role: str, m: WireMessage, buf: torch.Tensor, slot: int) -> _Prepared:
        """Message ``m`` packed into (send) or unpacked from (recv) slot ``slot``, whose bytes are ``buf``."""
        views = [_box_view(self._tensors[op.name], op.offset, op.shape) for op in m.ops]
        offsets = [op.byte_offset for op in m.ops]
        dtypes = [op.wire_dtype for op in m.ops]
        if role == "send":
            program = afc.gather_program(views, buf, offsets, dtypes)
        else:
            program = afc.scatter_program(buf, offsets, dtypes, views)
        return _Prepared(m, buf[: m.nbytes], program, slot)

    def _prepare_shared(self) -> None:
        """Copy programs between every message's boxes and its slot of the pair's channel (message
        ``tag`` uses slot ``tag % slots``; see `_run_shared_sends`)."""
        self._prepared = {}
        for (role, peer), msgs in self._all_pairs():
            chan = self._channels[(role, peer)]
            self._prepared[(role, peer)] = [
                self._staged(role, m, chan.slot(m.tag % chan.slots), m.tag % chan.slots) for m in msgs
            ]
        self._runners, self._runner_peers = {}, {}
        for role, by_peer in (("send", self._sends), ("recv", self._recvs)):
            if not by_peer:
                continue
            peers = list(by_peer)
            order = _round_robin({p: self._prepared[(role, p)] for p in peers})
            steps = []
            for peer, prep in order:
                chan, slot = self._channels[(role, peer)], prep.slot
                steps.append(
                    (peers.index(peer), chan.control_address(slot), chan.slot(slot).data_ptr(),
                     prep.msg.tag, prep.msg.nbytes, prep.program.desc)
                )
            runner = self.group.runner(role, peers, steps)
            self._runners[role], self._runner_peers[role] = (runner, order), peers

    def _open_channels(self) -> None:
        """Shared mode: each pair's channel (receivers create theirs, senders map them; every
        slot holds the pair's largest message), then the programs over their slots."""
        if not self.shared or self._channels:
            return
        # receivers first: a sender waits until its receiver created the channel
        for (role, peer), msgs in sorted(self._all_pairs(), key=lambda item: item[0][0] != "recv"):
            try:
                chan = self.group.channel(peer, role, "exec", self._slots, max(m.nbytes for m in msgs))
            except (TimeoutError, RuntimeError) as exc:
                raise TransferError(f"rank {self.rank} could not open its channel: {exc}", peer=peer) from exc
            self._channels[(role, peer)] = chan
            self._chunk_base[(role, peer)] = 0
        self._staging = {
            key: [chan.slot(i) for i in range(chan.slots)]
            for key, chan in self._channels.items()
            if key[0] == "recv"  # a receiver owns its channel's slots
        }
        self._prepare_shared()

    def _prepare_self(self) -> None:
        srcs, dsts = [], []
        for send, recv in self._self_pairs:
            for s_op, r_op in zip(send.ops, recv.ops, strict=True):
                srcs.append(_box_view(self._tensors[s_op.name], s_op.offset, s_op.shape))
                dsts.append(_box_view(self._tensors[r_op.name], r_op.offset, r_op.shape))
        self._self_program = afc.direct_program(srcs, dsts) if srcs else None

    # --- handshake ------------------------------------------------------------------------------

    def peers(self) -> list[int]:
        """Every other rank this rank exchanges messages with."""
        return sorted({*self._sends, *self._recvs})

    def _settings(self) -> dict:
        return {
            "digest": self.digest,
            "verify": self.verify,
            "message_bytes": self.message_bytes,
            "solo_bytes": self.solo_bytes,
            "shared": self.shared,
        }

    def handshake(self) -> None:
        """Compare plan digests and settings with every peer through the rendezvous store."""
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
        try:  # shared mode: map every channel now, so a dead peer shows before the first update
            self._open_channels()
        except TransferError:
            self.group.abort()
            raise

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

    def _revalidate(self) -> None:
        if self._storage_ptrs() != self._ptrs:  # a parameter was re-allocated: rebuild programs
            self._ptrs = self._storage_ptrs()
            self._prepare()

    def run(self, version: int) -> dict:
        """Send and receive every message of this rank for ``version``; on success the receiver's
        `version` becomes ``version``. Returns {"bytes_sent", "bytes_received", "seconds", ...}."""
        if self.shared:
            try:
                self._open_channels()
            except TransferError:
                self.group.abort()
                raise
        self._revalidate()
        self.trace = []
        t0 = time.perf_counter()
        try:
            if self._self_program is not None:
                self._self_program.run()
            if self.shared:
                sent = self._run_shared("send", version) if self._sends else 0
                received = self._run_shared("recv", version) if self._recvs else 0
                for key, msgs in self._all_pairs():  # next update: tag 0 in slot 0 again
                    slots = self._channels[key].slots
                    self._chunk_base[key] += -(-len(msgs) // slots) * slots
            else:
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
            "messages": sum(len(m) for _, m in self._all_pairs()),
            "seconds": time.perf_counter() - t0,
            "staging_bytes": self.staging_bytes,
        }

    def _wait(
        self, pending: Pending, peer: int, role: str, version: int, tag: int, bucket: int | None
    ) -> None:
        """Wait for one message; ``bucket`` None marks the closing checksum message."""
        self._bounded(lambda: pending.wait(self.timeout_s), peer, role, version, tag, bucket)

    def _bounded(
        self, step: Callable[[], object], peer: int, role: str, version: int, tag: int, bucket: int | None
    ) -> object:
        """Run one bounded wait (``step``), turning its failure into a TransferError."""
        try:
            return step()
        except (TimeoutError, RuntimeError) as exc:
            verb = "sending" if role == "send" else "receiving"
            what = f"message {tag}" if bucket is not None else "the checksum list"
            direction = "to" if role == "send" else "from"
            raise TransferError(
                f"rank {self.rank} failed {verb} {what} ({direction} its peer): {exc}",
                peer=peer,
                bucket=bucket,
                version=version,
            ) from exc

    def _post(
        self, role: str, wire: torch.Tensor, peer: int, tag: int, version: int, bucket: int | None
    ) -> Pending:
        try:
            post = self.group.isend if role == "send" else self.group.irecv
            return post(wire, peer, tag)
        except RuntimeError as exc:
            verb = "send" if role == "send" else "post a receive for"
            raise TransferError(
                f"rank {self.rank} could not {verb} message {tag}: {exc}",
                peer=peer,
                bucket=bucket,
                version=version,
            ) from exc

    def _run_sends(self, version: int) -> int:
        # Per peer: every posted send in order; the staged ones also hold a slot until done.
        inflight: dict[int, deque[_InFlight]] = {p: deque() for p in self._sends}
        busy = {p: [False] * self._slots_per_peer for p in self._sends}
        sent = 0
        for peer, prep in _round_robin({p: self._prepared[("send", p)] for p in self._sends}):
            q = inflight[peer]
            while len(q) >= self.window or (prep.slot is not None and busy[peer][prep.slot]):
                self._finish_send(q.popleft(), busy, version)
            m = prep.msg
            tr = MessageTrace("send", peer, m.tag, m.bucket, m.nbytes, prep.program is None)
            tr.pack_start = time.perf_counter()
            if prep.program is not None:
                prep.program.run()
                busy[peer][prep.slot] = True
            if self.verify:
                self._sums[("send", peer)][m.tag] = _signed(afc.checksum(prep.wire))
            tr.pack_end = tr.transfer_start = time.perf_counter()
            q.append((self._post("send", prep.wire, peer, m.tag, version, m.bucket), prep, tr))
            sent += m.nbytes
        for q in inflight.values():
            while q:
                self._finish_send(q.popleft(), busy, version)
        if self.verify:  # one message of every checksum per peer, after its data
            for peer, msgs in self._sends.items():
                pending = self._post("send", self._sums[("send", peer)], peer, len(msgs), version, None)
                self._wait(pending, peer, "send", version, len(msgs), None)
        return sent

    def _finish_send(
        self, item: _InFlight, busy: dict[int, list[bool]], version: int
    ) -> None:
        pending, prep, tr = item
        self._wait(pending, tr.peer, "send", version, tr.seq, tr.bucket)
        if prep.slot is not None:
            busy[tr.peer][prep.slot] = False
        tr.transfer_end = time.perf_counter()
        self.trace.append(tr)

    def _run_recvs(self, version: int) -> int:
        todo = {p: deque(self._prepared[("recv", p)]) for p in self._recvs}
        inflight: dict[int, deque[_InFlight]] = {p: deque() for p in self._recvs}
        busy = {p: [False] * self._slots_per_peer for p in self._recvs}

        def post_more(peer: int) -> None:
            # In order: stop at the first message whose slot still holds an earlier message.
            q, nxt = inflight[peer], todo[peer]
            while nxt and len(q) < self.window:
                prep = nxt[0]
                if prep.slot is not None:
                    if busy[peer][prep.slot]:
                        return
                    busy[peer][prep.slot] = True
                nxt.popleft()
                m = prep.msg
                tr = MessageTrace("recv", peer, m.tag, m.bucket, m.nbytes, prep.program is None)
                tr.transfer_start = time.perf_counter()
                q.append((self._post("recv", prep.wire, peer, m.tag, version, m.bucket), prep, tr))

        for peer in self._recvs:
            post_more(peer)
        sums: dict[int, list[int]] = {p: [0] * len(ms) for p, ms in self._recvs.items()}  # by tag
        join = getattr(self.group, "join_current_stream", None)
        received = 0
        for peer, _ in _round_robin({p: self._prepared[("recv", p)] for p in self._recvs}):
            pending, prep, tr = inflight[peer].popleft()  # posted: every earlier message is done
            self._wait(pending, peer, "recv", version, tr.seq, tr.bucket)
            tr.transfer_end = tr.unpack_start = time.perf_counter()
            if join is not None:
                join()
            if self.verify:
                sums[peer][prep.msg.tag] = afc.checksum(prep.wire)
            if prep.program is not None:
                prep.program.run()
                busy[peer][prep.slot] = False
            tr.unpack_end = time.perf_counter()
            self.trace.append(tr)
            received += prep.msg.nbytes
            post_more(peer)
        if self.verify:
            self._check_sums(sums, version)
        return received

    def _run_shared(self, role: str, version: int) -> int:
        """Shared mode: every message of ``role`` in one native pass (csrc/shm/runner.cpp), round
        robin over the peers. A sender waits for each message's slot to be free, packs into it
        and publishes it, then waits until every peer read its last message; a receiver waits for
        each message in its slot, unpacks it from there and frees the slot."""
        runner, steps = self._runners[role]
        bases = [self._chunk_base[(role, peer)] for peer in self._runner_peers[role]]
        status, failed, detail, times, sums = runner.run(bases, self.timeout_s, self.verify)
        if status != 0:
            peer, prep = steps[failed]
            m = prep.msg
            if status == _MISMATCH:
                raise TransferError(detail, peer=peer, bucket=m.bucket, version=version)
            verb, direction = ("sending", "to") if role == "send" else ("receiving", "from")
            raise TransferError(
                f"rank {self.rank} failed {verb} message {m.tag} ({direction} its peer): {detail}",
                peer=peer,
                bucket=m.bucket,
                version=version,
            )
        moved = 0
        got: dict[int, list[int]] = {p: [0] * len(ms) for p, ms in self._recvs.items()}
        checksums = sums or [None] * len(steps)
        for (peer, prep), (t0, t1, t2), total in zip(steps, times.tolist(), checksums, strict=True):
            m = prep.msg
            tr = MessageTrace(role, peer, m.tag, m.bucket, m.nbytes, False)
            if role == "send":
                tr.pack_start, tr.pack_end = t0, t1
                tr.transfer_start = tr.transfer_end = t1
                if total is not None:
                    self._sums[("send", peer)][m.tag] = _signed(total)
            else:
                tr.transfer_start, tr.transfer_end, tr.unpack_start, tr.unpack_end = t0, t1, t1, t2
                if total is not None:
                    got[peer][m.tag] = total
            self.trace.append(tr)
            moved += m.nbytes
        if self.verify and role == "send":
            for peer, msgs in self._sends.items():
                pending = self._post("send", self._sums[("send", peer)], peer, len(msgs), version, None)
                self._wait(pending, peer, "send", version, len(msgs), None)
        elif self.verify:
            self._check_sums(got, version)
        return moved

    def _check_sums(self, got: dict[int, list[int]], version: int) -> None:
        """Receive every sender's checksum list and compare it with what arrived."""
        for peer, msgs in self._recvs.items():
            buf = self._sums[("recv", peer)]
            pending = self._post("recv", buf, peer, len(msgs), version, None)
            self._wait(pending, peer, "recv", version, len(msgs), None)
            join = getattr(self.group, "join_current_stream", None)
            if join is not None:
                join()
            want = [v & ((1 << 64) - 1) for v in buf.cpu().tolist()]
            for m, w, g in zip(msgs, want, got[peer], strict=True):
                if w != g:
                    raise TransferError(
                        f"rank {self.rank}: checksum mismatch in message {m.tag} ({g:#x} != sent {w:#x})",
                        peer=peer,
                        bucket=m.bucket,
                        version=version,
                    )


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


def _round_robin(by_peer: Mapping[int, list[_Prepared]]) -> list[tuple[int, _Prepared]]:
    """Message k of every peer before message k+1 of any: all peers stay in flight together."""
    order, k = [], 0
    longest = max((len(ms) for ms in by_peer.values()), default=0)
    while k < longest:
        order.extend((p, ms[k]) for p, ms in by_peer.items() if k < len(ms))
        k += 1
    return order


def _signed(value: int) -> int:
    """The int64 two's complement of a u64 (checksums travel in an int64 tensor)."""
    return value - (1 << 64) if value >= 1 << 63 else value


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
