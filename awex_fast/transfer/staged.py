"""The staged strategy: every message is one tensor handed to the group's isend / irecv.

A message that holds one op (or a chunk of one, `WireMessage.solo`) whose box is contiguous in
the wire dtype travels from / into the parameter's own memory (zero-copy); any other message is
packed into (sender) or unpacked from (receiver) one of ``slots`` staging slots of its pair. A
sender packs staged message k+1 while message k is on the wire; a receiver keeps up to ``window``
messages posted per peer and unpacks staged message k while later ones arrive; peers are served
round robin, both sides in tag order (NCCL matches in issue order).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

import torch

from awex_fast.transfer import boxcopy as afc
from awex_fast.transfer.exchange import (
    Exchange,
    MessageTrace,
    PairKey,
    Prepared,
    box_view,
    round_robin,
    signed,
)
from awex_fast.transfer.wire import WireMessage
from awex_fast.transport.base import STAGED, Pending

SLOTS = 2  # staging slots per peer: staged message k+1 is packed while k is on the wire
MESSAGE_BYTES = 32 << 20
SOLO_BYTES = 256 << 10

_InFlight = tuple[Pending, Prepared, MessageTrace]


class StagedMessages:
    """The staged strategy over any `TransferGroup` (see the module docstring).

    ``staging_limit_bytes``: cap on staging memory (default ``slots`` x the largest staged
    message per active peer); when that does not fit, fewer slots per peer are used, down to
    one, and if even one does not fit, `prepare` raises ValueError."""

    name = STAGED

    def __init__(
        self, exchange: Exchange, *, slots: int, zero_copy: bool, staging_limit_bytes: int | None
    ) -> None:
        self.exchange = exchange
        self.zero_copy = zero_copy
        self._slots, self._staging_limit = slots, staging_limit_bytes
        self.slots_per_peer = slots
        self.prepared: dict[PairKey, list[Prepared]] = {}
        self.staging: dict[PairKey, list[torch.Tensor]] = {}

    # --- setup ----------------------------------------------------------------------------------

    def _direct_view(self, m: WireMessage) -> torch.Tensor | None:
        """The parameter's own memory as the message's wire bytes, when the message allows it."""
        if not self.zero_copy or not m.solo:
            return None
        op = m.ops[0]
        view = box_view(self.exchange.tensors[op.name], op.offset, op.shape)
        if view.dtype != op.wire_dtype or not view.is_contiguous() or op.nbytes != m.nbytes:
            return None
        return view.reshape(-1)

    def _allocate_staging(
        self, direct: Mapping[PairKey, list[torch.Tensor | None]]
    ) -> tuple[int, dict[PairKey, list[torch.Tensor]]]:
        """Slots per peer and the staging slots of every pair with a staged message (``direct``:
        each pair's messages' zero-copy views, None where the message is staged)."""
        ex = self.exchange
        need: dict[PairKey, int] = {}
        for key, msgs in ex.all_pairs():
            staged = [m.nbytes for m, view in zip(msgs, direct[key], strict=True) if view is None]
            if staged:
                need[key] = max(staged)
        slots, limit = self._slots, self._staging_limit
        per_slot = sum(need.values())
        if limit is not None and slots * per_slot > limit:
            slots = limit // per_slot if per_slot else slots
            if slots < 1:
                raise ValueError(
                    f"rank {ex.rank}: staging needs at least {per_slot} bytes (one message per active "
                    f"peer) but the limit is {limit}; lower message_bytes"
                )
        staging = {}
        for key, nbytes in need.items():
            # 16-byte multiples keep every slot aligned for vectorised copies.
            size = (nbytes + 15) // 16 * 16
            staging[key] = [torch.empty(size, dtype=torch.uint8, device=ex.device) for _ in range(slots)]
        return slots, staging

    def prepare(self) -> None:
        """Decide zero-copy per message, allocate staging for the rest, build the copy programs."""
        ex = self.exchange
        direct = {key: [self._direct_view(m) for m in msgs] for key, msgs in ex.all_pairs()}
        self.slots_per_peer, self.staging = self._allocate_staging(direct)
        self.prepared = {}
        for (role, peer), msgs in ex.all_pairs():
            out, staged = [], 0
            for m, view in zip(msgs, direct[(role, peer)], strict=True):
                if view is not None:
                    out.append(Prepared(m, view, None, None))
                    continue
                slot = staged % self.slots_per_peer
                staged += 1
                out.append(ex.staged(role, m, self.staging[(role, peer)][slot], slot))
            self.prepared[(role, peer)] = out

    def open(self) -> None:
        """Nothing to open: isend / irecv need no connection of the executor's own."""

    # --- one update -----------------------------------------------------------------------------

    def run(self, version: int) -> tuple[int, int]:
        """Every send, then every receive, of ``version``; returns (bytes sent, bytes received)."""
        ex = self.exchange
        sent = self._run_sends(version) if ex.sends else 0
        received = self._run_recvs(version) if ex.recvs else 0
        return sent, received

    def _run_sends(self, version: int) -> int:
        # Per peer: every posted send in order; the staged ones also hold a slot until done.
        ex = self.exchange
        inflight: dict[int, deque[_InFlight]] = {p: deque() for p in ex.sends}
        busy = {p: [False] * self.slots_per_peer for p in ex.sends}
        sent = 0
        for peer, prep in round_robin({p: self.prepared[("send", p)] for p in ex.sends}):
            q = inflight[peer]
            while len(q) >= ex.window or (prep.slot is not None and busy[peer][prep.slot]):
                self._finish_send(q.popleft(), busy, version)
            m = prep.msg
            tr = MessageTrace("send", peer, m.tag, m.bucket, m.nbytes, prep.program is None)
            tr.pack_start = time.perf_counter()
            if prep.program is not None:
                prep.program.run()
                busy[peer][prep.slot] = True
            if ex.verify:
                ex.sums[("send", peer)][m.tag] = signed(afc.checksum(prep.wire))
            tr.pack_end = tr.transfer_start = time.perf_counter()
            q.append((ex.post("send", prep.wire, peer, m.tag, version, m.bucket), prep, tr))
            sent += m.nbytes
        for q in inflight.values():
            while q:
                self._finish_send(q.popleft(), busy, version)
        if ex.verify:
            ex.send_sums(version)
        return sent

    def _finish_send(self, item: _InFlight, busy: dict[int, list[bool]], version: int) -> None:
        pending, prep, tr = item
        self.exchange.wait(pending, tr.peer, "send", version, tr.seq, tr.bucket)
        if prep.slot is not None:
            busy[tr.peer][prep.slot] = False
        tr.transfer_end = time.perf_counter()
        self.exchange.trace.append(tr)

    def _run_recvs(self, version: int) -> int:
        ex = self.exchange
        todo = {p: deque(self.prepared[("recv", p)]) for p in ex.recvs}
        inflight: dict[int, deque[_InFlight]] = {p: deque() for p in ex.recvs}
        busy = {p: [False] * self.slots_per_peer for p in ex.recvs}

        def post_more(peer: int) -> None:
            # In order: stop at the first message whose slot still holds an earlier message.
            q, nxt = inflight[peer], todo[peer]
            while nxt and len(q) < ex.window:
                prep = nxt[0]
                if prep.slot is not None:
                    if busy[peer][prep.slot]:
                        return
                    busy[peer][prep.slot] = True
                nxt.popleft()
                m = prep.msg
                tr = MessageTrace("recv", peer, m.tag, m.bucket, m.nbytes, prep.program is None)
                tr.transfer_start = time.perf_counter()
                q.append((ex.post("recv", prep.wire, peer, m.tag, version, m.bucket), prep, tr))

        for peer in ex.recvs:
            post_more(peer)
        sums: dict[int, list[int]] = {p: [0] * len(ms) for p, ms in ex.recvs.items()}  # by tag
        received = 0
        for peer, _ in round_robin({p: self.prepared[("recv", p)] for p in ex.recvs}):
            pending, prep, tr = inflight[peer].popleft()  # posted: every earlier message is done
            ex.wait(pending, peer, "recv", version, tr.seq, tr.bucket)
            tr.transfer_end = tr.unpack_start = time.perf_counter()
            ex.group.join_current_stream()
            if ex.verify:
                sums[peer][prep.msg.tag] = afc.checksum(prep.wire)
            if prep.program is not None:
                prep.program.run()
                busy[peer][prep.slot] = False
            tr.unpack_end = time.perf_counter()
            ex.trace.append(tr)
            received += prep.msg.nbytes
            post_more(peer)
        if ex.verify:
            ex.check_sums(sums, version)
        return received
