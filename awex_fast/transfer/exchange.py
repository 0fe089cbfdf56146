"""What the executor's two strategies share: one rank's messages per pair, its local tensors, the
bounded posts and waits that turn a transport failure into a `TransferError`, the checksum lists
of ``verify``, and the per-message trace.

A strategy (`MessageStrategy`) moves the messages of one update; which one runs is declared by the
transfer group (`TransferGroup.strategy`): `awex_fast.transfer.staged` over any group,
`awex_fast.transfer.shared_slots` over a `SharedSlotGroup` (ipc). The contract of an update is the
executor's (awex_fast.transfer.executor).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from awex_fast.transfer import boxcopy as afc
from awex_fast.transfer.wire import WireMessage
from awex_fast.transport.base import Pending, TransferError, TransferGroup

PairKey = tuple[str, int]  # (role, peer)


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
class Prepared:
    """One message made ready: its wire tensor and, when staged, the copy program and slot."""

    msg: WireMessage
    wire: torch.Tensor  # bytes on the wire: a staging slot's prefix or the parameter's own memory
    program: afc.CopyProgram | None  # None: zero-copy
    slot: int | None  # staging slot index (None: zero-copy)


def box_view(t: torch.Tensor, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """The box (``offset``, ``shape``) of ``t``."""
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return t[index] if index else t


def round_robin(by_peer: Mapping[int, list[Prepared]]) -> list[tuple[int, Prepared]]:
    """Message k of every peer before message k+1 of any: all peers stay in flight together."""
    order, k = [], 0
    longest = max((len(ms) for ms in by_peer.values()), default=0)
    while k < longest:
        order.extend((p, ms[k]) for p, ms in by_peer.items() if k < len(ms))
        k += 1
    return order


def signed(value: int) -> int:
    """The int64 two's complement of a u64 (checksums travel in an int64 tensor)."""
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class Exchange:
    """One rank's side of the exchange, as both strategies see it: the group, the messages of
    every (role, peer) pair (``sends`` / ``recvs`` by peer, peers sorted), the local tensors the
    ops address, the checksum lists (``verify``) and the trace of the running update."""

    group: TransferGroup
    timeout_s: float
    verify: bool
    window: int  # messages posted ahead per peer
    tensors: dict[str, torch.Tensor]
    sends: dict[int, list[WireMessage]]
    recvs: dict[int, list[WireMessage]]
    device: torch.device
    sums: dict[PairKey, torch.Tensor] = field(default_factory=dict)
    trace: list[MessageTrace] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.verify:  # per-message checksums exchanged at the end of an update
            self.sums = {
                key: torch.empty(len(msgs), dtype=torch.int64, device=self.device)
                for key, msgs in self.all_pairs()
            }

    @property
    def rank(self) -> int:
        """This rank's transfer rank."""
        return self.group.rank

    def all_pairs(self) -> list[tuple[PairKey, list[WireMessage]]]:
        """Every (role, peer) pair with its messages: sends first, then receives."""
        return [(("send", p), m) for p, m in self.sends.items()] + [
            (("recv", p), m) for p, m in self.recvs.items()
        ]

    def staged(self, role: str, m: WireMessage, buf: torch.Tensor, slot: int) -> Prepared:
        """Message ``m`` packed into (send) or unpacked from (recv) slot ``slot``, whose bytes are ``buf``."""
        views = [box_view(self.tensors[op.name], op.offset, op.shape) for op in m.ops]
        offsets = [op.byte_offset for op in m.ops]
        dtypes = [op.wire_dtype for op in m.ops]
        if role == "send":
            program = afc.gather_program(views, buf, offsets, dtypes)
        else:
            program = afc.scatter_program(buf, offsets, dtypes, views)
        return Prepared(m, buf[: m.nbytes], program, slot)

    # --- bounded transport steps ------------------------------------------------------------------

    def params_of(self, role: str, peer: int, tag: int) -> tuple[str, ...]:
        """The parameters data message ``tag`` of the (``role``, ``peer``) pair carries."""
        msgs = (self.sends if role == "send" else self.recvs).get(peer, [])
        if not 0 <= tag < len(msgs):
            return ()
        return tuple(dict.fromkeys(op.name for op in msgs[tag].ops))

    def post(
        self, role: str, wire: torch.Tensor, peer: int, tag: int, version: int, bucket: int | None
    ) -> Pending:
        """Post one send or receive; a refusal becomes a TransferError naming the message."""
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
                params=self.params_of(role, peer, tag) if bucket is not None else (),
            ) from exc

    def wait(
        self, pending: Pending, peer: int, role: str, version: int, tag: int, bucket: int | None
    ) -> None:
        """Wait for one message; ``bucket`` None marks a closing message (checksums, outcome)."""
        self.bounded(lambda: pending.wait(self.timeout_s), peer, role, version, tag, bucket)

    def bounded(
        self, step: Callable[[], object], peer: int, role: str, version: int, tag: int, bucket: int | None
    ) -> object:
        """Run one bounded wait (``step``), turning its failure into a TransferError."""
        try:
            return step()
        except (TimeoutError, RuntimeError) as exc:
            verb = "sending" if role == "send" else "receiving"
            what = f"message {tag}" if bucket is not None else "the closing checksum list or outcome"
            direction = "to" if role == "send" else "from"
            raise TransferError(
                f"rank {self.rank} failed {verb} {what} ({direction} its peer): {exc}",
                peer=peer,
                bucket=bucket,
                version=version,
                params=self.params_of(role, peer, tag) if bucket is not None else (),
            ) from exc

    # --- verify ---------------------------------------------------------------------------------

    def send_sums(self, version: int) -> None:
        """One message of every checksum per peer, after its data (``verify``)."""
        for peer, msgs in self.sends.items():
            pending = self.post("send", self.sums[("send", peer)], peer, len(msgs), version, None)
            self.wait(pending, peer, "send", version, len(msgs), None)

    def check_sums(self, got: dict[int, list[int]], version: int) -> None:
        """Receive every sender's checksum list and compare it with what arrived (``got``: per
        peer, the checksum of each message by tag)."""
        for peer, msgs in self.recvs.items():
            buf = self.sums[("recv", peer)]
            pending = self.post("recv", buf, peer, len(msgs), version, None)
            self.wait(pending, peer, "recv", version, len(msgs), None)
            self.group.join_current_stream()
            want = [v & ((1 << 64) - 1) for v in buf.cpu().tolist()]
            for m, w, g in zip(msgs, want, got[peer], strict=True):
                if w != g:
                    raise TransferError(
                        f"rank {self.rank}: checksum mismatch in message {m.tag} ({g:#x} != sent {w:#x})",
                        peer=peer,
                        bucket=m.bucket,
                        version=version,
                    )


    # --- the round's outcome --------------------------------------------------------------------

    def _ack_tag(self, peer: int, role: str) -> int:
        # after the data messages (tags 0..n-1) and the checksum list (tag n)
        return len((self.recvs if role == "recv" else self.sends)[peer]) + 1

    def tell_senders(self, version: int, landed: bool, timeout_s: float | None = None) -> None:
        """Receiver side: tell every sender whether ``version`` landed here ([version, 1 or 0]).
        Waits at most ``timeout_s`` per peer (default the exchange's); raises TransferError."""
        status = torch.tensor([version, 1 if landed else 0], dtype=torch.int64, device=self.device)
        posted = [(peer, self.post("send", status, peer, self._ack_tag(peer, "recv"), version, None))
                  for peer in self.recvs]
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        for peer, pending in posted:
            self.bounded(lambda p=pending: p.wait(wait_s), peer, "send", version,
                         self._ack_tag(peer, "recv"), None)

    def hear_receivers(self, version: int, timeout_s: float) -> None:
        """Sender side: wait (at most ``timeout_s`` per receiver) until every receiver says
        ``version`` landed; a receiver that says it did not (its checksums disagreed, it failed)
        raises TransferError naming it."""
        posted = []
        for peer in self.sends:
            status = torch.zeros(2, dtype=torch.int64, device=self.device)
            posted.append((peer, status, self.post("recv", status, peer, self._ack_tag(peer, "send"), version,
                                                   None)))
        for peer, status, pending in posted:
            self.bounded(lambda p=pending: p.wait(timeout_s), peer, "recv", version,
                         self._ack_tag(peer, "send"), None)
            self.group.join_current_stream()
            got_version, landed = status.cpu().tolist()
            if got_version != version or landed != 1:
                raise TransferError(
                    f"rank {self.rank}: receiver rank {peer} reports that version {version} did not land "
                    f"there (status {landed} for version {got_version}); its own error names the cause",
                    peer=peer,
                    version=version,
                )


class MessageStrategy(Protocol):
    """How the messages of one update move (chosen by the group's declared ``strategy``).

    `prepare` builds whatever the strategy reuses between updates (again whenever a local
    tensor's storage moved); `open` makes the pairs' connections (idempotent; called at the
    handshake and before each update); `run` moves every message of one update and returns
    (bytes sent, bytes received), raising `TransferError`."""

    name: str
    exchange: Exchange
    prepared: dict[PairKey, list[Prepared]]
    staging: dict[PairKey, list[torch.Tensor]]

    def prepare(self) -> None:
        """Build the copy programs (and staging) of every message."""
        ...

    def open(self) -> None:
        """Open the pairs' connections, if this strategy has any."""
        ...

    def run(self, version: int) -> tuple[int, int]:
        """Move every message of ``version``; returns (bytes sent, bytes received)."""
        ...
