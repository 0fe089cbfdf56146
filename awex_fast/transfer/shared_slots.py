"""The shared-slot strategy, over a `SharedSlotGroup` (the ``ipc`` backend): nothing is staged by
the executor. Each (sender, receiver) pair has one channel of ``slots`` shared slots, each as
large as the pair's largest message, created by the receiver and mapped by the sender; message
``tag`` is packed straight into slot ``tag % slots`` of the receiver's channel and unpacked
straight out of it. A whole role's messages replay in one native pass (`SharedSlotGroup.runner`,
csrc/shm/runner.cpp), round robin over the peers, with no Python between messages.
"""

from __future__ import annotations

import torch

from awex_fast.transfer.exchange import Exchange, MessageTrace, PairKey, Prepared, round_robin, signed
from awex_fast.transport.base import SHARED_SLOTS, SharedSlotGroup, SlotChannel, SlotRunner, TransferError

SLOTS = 4  # more slots let a sender run further ahead of a busy receiver
# Nothing is zero-copy, so ops are only cut to fit a slot, and small messages keep the slots
# cache-sized.
MESSAGE_BYTES = 4 << 20
_MISMATCH = 5  # the native runner's status for "the peer published another message"


class SharedSlotMessages:
    """The shared-slot strategy (see the module docstring). The channels open at the handshake
    (so that a dead peer shows before the first update) or, at the latest, before an update."""

    name = SHARED_SLOTS

    def __init__(self, exchange: Exchange, group: SharedSlotGroup, *, slots: int) -> None:
        self.exchange, self.group, self.slots = exchange, group, slots
        self.prepared: dict[PairKey, list[Prepared]] = {}
        self.staging: dict[PairKey, list[torch.Tensor]] = {}  # a receiver's channel slots
        self._channels: dict[PairKey, SlotChannel] = {}
        self._chunk_base: dict[PairKey, int] = {}  # chunk number of tag 0, per pair
        self._runners: dict[str, tuple[SlotRunner, list[tuple[int, Prepared]]]] = {}
        self._runner_peers: dict[str, list[int]] = {}

    def open(self) -> None:
        """Each pair's channel (receivers create theirs, senders map them; every slot holds the
        pair's largest message), then the programs over their slots. Idempotent."""
        if self._channels:
            return
        ex = self.exchange
        # receivers first: a sender waits until its receiver created the channel
        for (role, peer), msgs in sorted(ex.all_pairs(), key=lambda item: item[0][0] != "recv"):
            try:
                chan = self.group.channel(peer, role, "exec", self.slots, max(m.nbytes for m in msgs))
            except (TimeoutError, RuntimeError) as exc:
                raise TransferError(f"rank {ex.rank} could not open its channel: {exc}", peer=peer) from exc
            self._channels[(role, peer)] = chan
            self._chunk_base[(role, peer)] = 0
        self.staging = {
            key: [chan.slot(i) for i in range(chan.slots)]
            for key, chan in self._channels.items()
            if key[0] == "recv"  # a receiver owns its channel's slots
        }
        self.prepare()

    def prepare(self) -> None:
        """Copy programs between every message's boxes and its slot of the pair's channel, and one
        native runner per role; nothing to build until the channels are open."""
        if not self._channels:
            return
        ex = self.exchange
        self.prepared = {}
        for (role, peer), msgs in ex.all_pairs():
            chan = self._channels[(role, peer)]
            self.prepared[(role, peer)] = [
                ex.staged(role, m, chan.slot(m.tag % chan.slots), m.tag % chan.slots) for m in msgs
            ]
        self._runners, self._runner_peers = {}, {}
        for role, by_peer in (("send", ex.sends), ("recv", ex.recvs)):
            if not by_peer:
                continue
            peers = list(by_peer)
            order = round_robin({p: self.prepared[(role, p)] for p in peers})
            steps = []
            for peer, prep in order:
                chan, slot = self._channels[(role, peer)], prep.slot
                steps.append(
                    (peers.index(peer), chan.control_address(slot), chan.slot(slot).data_ptr(),
                     prep.msg.tag, prep.msg.nbytes, prep.program.desc)
                )
            runner = self.group.runner(role, peers, steps)
            self._runners[role], self._runner_peers[role] = (runner, order), peers

    def run(self, version: int) -> tuple[int, int]:
        """Every send, then every receive, of ``version``; then the next update's tag 0 goes to
        slot 0 again. Returns (bytes sent, bytes received)."""
        ex = self.exchange
        sent = self._run_role("send", version) if ex.sends else 0
        received = self._run_role("recv", version) if ex.recvs else 0
        for key, msgs in ex.all_pairs():
            slots = self._channels[key].slots
            self._chunk_base[key] += -(-len(msgs) // slots) * slots
        return sent, received

    def _run_role(self, role: str, version: int) -> int:
        """Every message of ``role`` in one native pass, round robin over the peers. A sender waits
        for each message's slot to be free, packs into it and publishes it, then waits until every
        peer read its last message; a receiver waits for each message in its slot, unpacks it from
        there and frees the slot."""
        ex = self.exchange
        runner, steps = self._runners[role]
        bases = [self._chunk_base[(role, peer)] for peer in self._runner_peers[role]]
        status, failed, detail, times, sums = runner.run(bases, ex.timeout_s, ex.verify)
        if status != 0:
            self._raise_failure(role, version, status, steps[failed], detail)
        moved = 0
        got: dict[int, list[int]] = {p: [0] * len(ms) for p, ms in ex.recvs.items()}
        checksums = sums or [None] * len(steps)
        for (peer, prep), (t0, t1, t2), total in zip(steps, times.tolist(), checksums, strict=True):
            m = prep.msg
            tr = MessageTrace(role, peer, m.tag, m.bucket, m.nbytes, False)
            if role == "send":
                tr.pack_start, tr.pack_end = t0, t1
                tr.transfer_start = tr.transfer_end = t1
                if total is not None:
                    ex.sums[("send", peer)][m.tag] = signed(total)
            else:
                tr.transfer_start, tr.transfer_end, tr.unpack_start, tr.unpack_end = t0, t1, t1, t2
                if total is not None:
                    got[peer][m.tag] = total
            ex.trace.append(tr)
            moved += m.nbytes
        if ex.verify and role == "send":
            ex.send_sums(version)
        elif ex.verify:
            ex.check_sums(got, version)
        return moved

    def _raise_failure(
        self, role: str, version: int, status: int, step: tuple[int, Prepared], detail: str
    ) -> None:
        """The runner's failure at ``step`` as a TransferError naming the peer and the message."""
        peer, prep = step
        m = prep.msg
        params = tuple(dict.fromkeys(op.name for op in m.ops))
        if status == _MISMATCH:
            raise TransferError(detail, peer=peer, bucket=m.bucket, version=version, params=params)
        verb, direction = ("sending", "to") if role == "send" else ("receiving", "from")
        raise TransferError(
            f"rank {self.exchange.rank} failed {verb} message {m.tag} ({direction} its peer): {detail}",
            peer=peer,
            bucket=m.bucket,
            version=version,
            params=params,
        )
