"""ipc: a transfer backend for ranks that share one host, over POSIX shared memory (CPU tensors).

Why: between processes of one machine a socket transport copies every byte twice through the
kernel (sender -> socket buffer -> receiver) on top of whatever packing the executor does. Here a
*channel* per (sender, receiver) pair is a shared segment of slots that both processes map: the
executor packs (and casts) straight into the receiver's slot and the receiver unpacks straight
out of it (`Channel`; the group declares ``strategy = SHARED_SLOTS``, and the executor's
shared-slot strategy, awex_fast.transfer.shared_slots, replays a whole update's messages through
`IpcTransferGroup.runner`, csrc/shm/runner.cpp, with no Python between messages), so a staged
message costs one copy per side and nothing else. Its segments come from awex_fast.transport.shm.
Plain `isend`/`irecv` (baselines, checksum lists) stream through a channel of their own in
``chunk_bytes`` pieces, pipelined, and progress whenever this rank waits on any of them (one
caller thread; no progress thread of its own).

Synchronisation (csrc/shm/sync.cpp): per slot, the sender release-stores ``ready = n + 1`` once
chunk ``n`` is in it and the receiver release-stores ``consumed = n + 1`` once it has read it;
chunk ``n`` lives in slot ``n % slots``. Each rank owns a futex doorbell that peers ring after
every store meant for it, so a waiter sleeps in the kernel instead of spinning (this host may
have fewer cores than ranks). Every wait is bounded by its timeout, wakes at least every
``_SLICE_S`` to check that the peer process is alive and has not aborted, and raises
TimeoutError or RuntimeError naming the peer.

Segments (``/dev/shm/awex_ipc_<token>_p<owner pid>_...``) are created by their owner (a rank's
doorbell) or the receiver (a channel), named in the group's rendezvous store, and unlinked as
soon as the peer mapped them. A process killed before that (during init, or after making a
channel its sender never mapped) cannot unlink its own: every init first reaps such orphans
(`awex_fast.transport.shm.reap_orphans`: the owner pid is gone and the owner's ``flock`` on the file
was released by the kernel). Every rank must see the same /dev/shm (one host, one mount
namespace): the group checks at init by opening every peer's doorbell, and refuses with a
message that names the rank it cannot reach; a rank that dies during init is named too.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import DistError, DistStoreError

from awex_fast._native import native
from awex_fast.transport.base import SHARED_SLOTS, check_peer, make_store, timedelta
from awex_fast.transport.shm import SegmentError, SharedSegment, pid_alive, reap_orphans

_SLICE_S = 0.1  # longest sleep between liveness / abort checks of a waiting rank
_CLOSED_AT = 64  # byte offset, in a rank's doorbell segment, of its "group closed" word
_HEADER = 64  # channel header: magic, slots, slot_bytes, aborted (one cache line)
_CTL = 64  # per-slot control line: ready, nbytes, tag, consumed
_MAGIC = 0x617765785F697063  # "awex_ipc"
CHUNK_BYTES = 4 << 20  # slot size of the isend/irecv channel
CHUNK_SLOTS = 4
PREFIX = "awex_ipc_"  # every segment of this backend: /dev/shm/awex_ipc_<token>_p<owner pid>_...
_REAP_AGE_S = 1.0  # an orphan is reaped once this old (see awex_fast.transport.shm.reap_orphans)
_INIT_POLL_S = 0.1  # how often init looks at the pids of the ranks it waits for


def _page_round(n: int) -> int:
    return (n + 4095) // 4096 * 4096


class Channel:
    """The shared slots of one (sender, receiver) pair, seen from one of the two sides.

    Chunk ``n`` of the pair's stream lives in slot ``n % slots``; the sender waits until
    `can_acquire` (or calls `acquire`) then `publish`es, the receiver waits until `is_ready`,
    reads `header` and `release`s. ``slot(i)`` is slot ``i``'s uint8 tensor, stable for the
    channel's life. The executor runs the same protocol natively (`IpcTransferGroup.runner`).
    """

    def __init__(
        self, group: IpcTransferGroup, segment: SharedSegment, peer: int, role: str, name: str
    ) -> None:
        self.group, self.segment, self.peer, self.role, self.name = group, segment, peer, role, name
        words = segment.tensor[:_HEADER].view(torch.int64)
        if int(words[0]) != _MAGIC:
            raise RuntimeError(f"ipc channel {name!r} with rank {peer}: segment is not an awex_fast channel")
        self.slots, self.slot_bytes = int(words[1]), int(words[2])
        self._base = segment.base
        self._data = _page_round(_HEADER + self.slots * _CTL)
        self._slot_tensors = [
            segment.tensor[self._data + i * self.slot_bytes : self._data + (i + 1) * self.slot_bytes]
            for i in range(self.slots)
        ]

    # addresses of the shared words
    def _aborted_addr(self) -> int:
        return self._base + 24

    def _ctl(self, slot: int, field: int) -> int:
        return self._base + _HEADER + slot * _CTL + 8 * field  # 0 ready, 1 nbytes, 2 tag, 3 consumed, 4 total

    def slot(self, index: int) -> torch.Tensor:
        """Slot ``index``'s bytes."""
        return self._slot_tensors[index]

    def control_address(self, index: int) -> int:
        """Address of slot ``index``'s control line (ready, nbytes, tag, consumed, total)."""
        return self._ctl(index, 0)

    @property
    def aborted_address(self) -> int:
        """Address of the channel's abort word (nonzero once either side aborted)."""
        return self._aborted_addr()

    # --- non-blocking probes (the isend/irecv progress engine uses these) -----------------------

    def can_acquire(self, n: int) -> bool:
        """Sender: chunk ``n``'s slot no longer holds an unread chunk (chunk numbers may skip:
        the slot is free once the receiver released whatever was published in it last)."""
        shm, s = native().shm, n % self.slots
        return shm.load(self._ctl(s, 3)) >= shm.load(self._ctl(s, 0))

    def is_ready(self, n: int) -> bool:
        """Receiver: chunk ``n`` was published."""
        return native().shm.load(self._ctl(n % self.slots, 0)) >= n + 1

    def consumed_through(self, n: int) -> bool:
        """Sender: chunk ``n`` was read and released by the receiver."""
        return native().shm.load(self._ctl(n % self.slots, 3)) >= n + 1

    # --- the four steps -------------------------------------------------------------------------

    def acquire(self, n: int, timeout_s: float) -> torch.Tensor:
        """Sender: wait until chunk ``n``'s slot is free; returns the slot."""
        self.group.wait_for(lambda: self.can_acquire(n), self.peer, timeout_s, f"a free slot for chunk {n}")
        return self._slot_tensors[n % self.slots]

    def publish(self, n: int, nbytes: int, tag: int, total: int = 0) -> None:
        """Sender: chunk ``n`` (``nbytes`` of message ``tag``, whose size is ``total``) is in its slot."""
        shm, s = native().shm, n % self.slots
        if not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"chunk of {nbytes} bytes does not fit a {self.slot_bytes}-byte slot")
        shm.store(self._ctl(s, 1), nbytes)
        shm.store(self._ctl(s, 2), tag)
        shm.store(self._ctl(s, 4), total)
        shm.store(self._ctl(s, 0), n + 1)  # release: the data and the two words above are visible
        self.group.ring(self.peer)

    def header(self, n: int) -> tuple[torch.Tensor, int]:
        """Receiver: the bytes and tag of published chunk ``n``."""
        shm, s = native().shm, n % self.slots
        nbytes, tag = shm.load(self._ctl(s, 1)), shm.load(self._ctl(s, 2))
        return self._slot_tensors[s][:nbytes], tag

    def total(self, n: int) -> int:
        """Receiver: the size of the message published chunk ``n`` belongs to."""
        return native().shm.load(self._ctl(n % self.slots, 4))

    def release(self, n: int) -> None:
        """Receiver: chunk ``n`` was read; its slot may be reused."""
        native().shm.store(self._ctl(n % self.slots, 3), n + 1)
        self.group.ring(self.peer)

    @property
    def peer_aborted(self) -> bool:
        """The peer (or this rank) aborted the group."""
        return native().shm.load(self._aborted_addr()) != 0

    def mark_aborted(self) -> None:
        """Tell the peer this channel is dead."""
        native().shm.store(self._aborted_addr(), 1)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor, src_offset: int, nbytes: int, streaming: bool) -> None:
    """Copy ``nbytes`` from byte ``src_offset`` of the uint8 tensor ``src`` to the start of
    ``dst`` with the native CPU copy (GIL released)."""
    if nbytes:
        native().copy.copy_bytes(dst.data_ptr(), src.data_ptr() + src_offset, nbytes, streaming)


@dataclass
class _Stream:
    """A plain isend/irecv in progress: ``data`` (uint8) in ``chunk_bytes`` chunks."""

    role: str
    peer: int
    tag: int
    data: torch.Tensor
    chunks: int
    done_chunks: int = 0
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.done_chunks >= self.chunks


class _IpcPending:
    def __init__(self, group: IpcTransferGroup, stream: _Stream) -> None:
        self._group, self._stream = group, stream

    def wait(self, timeout_s: float) -> None:
        """Drive every pending isend/irecv of the group until this one is done."""
        self._group.complete(self._stream, timeout_s)


class IpcTransferGroup:
    """A TransferGroup of processes that share /dev/shm (see the module docstring)."""

    backend = "ipc"
    strategy = SHARED_SLOTS  # a SharedSlotGroup: executors pack into the receiver's slots

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        group_name: str = "awex_fast",
        store: torch.distributed.Store | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.chunk_bytes = int(chunk_bytes)
        self.store = make_store(
            master_addr, master_port, rank, world_size, timeout_s, f"{group_name}/", store
        )
        self._closed = False
        self._lock = threading.RLock()
        self._channels: dict[tuple[str, int, str], Channel] = {}
        self._streams: dict[tuple[str, int], deque[_Stream]] = {}
        self._next_chunk: dict[tuple[str, int], int] = {}
        self._pids: dict[int, int] = {}  # rank -> pid, once the rank joined
        self._peer_bells: dict[int, SharedSegment] = {}
        reap_orphans(PREFIX, _REAP_AGE_S)  # what killed groups left behind (module docstring)
        if rank == 0:
            self.store.set("ipc/token", secrets.token_hex(6))
        self._await_keys({0: "ipc/token"}, "publish the group's token")
        self._token = self.store.get("ipc/token").decode()
        self._bell = self._segment("bell", str(rank), 4096)
        try:
            self.store.set(f"ipc/rank{rank}", json.dumps({"pid": os.getpid(), "bell": self._bell.name}))
            for peer in range(world_size):
                if peer != rank:
                    self._join_peer(peer)
            # Every peer mapped our doorbell: drop its name so that no crash can leak it.
            self.store.set(f"ipc/opened{rank}", "1")
            self._await_keys({p: f"ipc/opened{p}" for p in range(world_size) if p != rank},
                             "open every peer's doorbell segment")
            # The store lives in rank 0's process: rank 0 stays until every peer is past its last
            # init read, so a rank 0 that returns and exits at once cannot take the store away
            # from a peer still waiting above.
            if rank == 0:
                self._await_keys({p: f"ipc/joined{p}" for p in range(1, world_size)},
                                 "finish init_transfer_group")
            else:
                self.store.set(f"ipc/joined{rank}", "1")
        except Exception as exc:
            self._tell_failure(exc)
            raise
        finally:
            self._bell.unlink()

    def _tell_failure(self, exc: Exception) -> None:
        """Publish why this rank gives up init (the first failure wins), so that peers which
        can no longer open this rank's doorbell report the cause and not a missing segment."""
        with contextlib.suppress(Exception):
            if self.store.add("ipc/failures", 1) == 1:
                self.store.set("ipc/failed", str(exc) if "init_transfer_group" in str(exc)
                               else f"rank {self.rank} failed in init_transfer_group: {exc}")

    def _raise_if_failed(self) -> None:
        if self.store.check(["ipc/failed"]):
            raise RuntimeError(f"ipc: init_transfer_group failed on another rank: "
                               f"{self.store.get('ipc/failed').decode()}")

    def _segment(self, kind: str, suffix: str, size: int) -> SharedSegment:
        """A new segment owned by this process, named so that `reap_orphans` can find its owner."""
        name = f"{PREFIX}{self._token}_p{os.getpid()}_{kind}{suffix}"
        return SharedSegment(name, size, create=True, owner_lock=True)

    def _await_keys(self, keys: dict[int, str], what: str) -> None:
        """Wait until every rank in ``keys`` set its store key (it did ``what``). Raises naming the
        ranks that did not: RuntimeError as soon as one of them is seen dead, else TimeoutError
        after the group's timeout."""
        deadline = time.monotonic() + self.timeout_s
        missing = dict(keys)
        while True:
            try:
                # a blocking wait (answered the moment the keys appear, so a rank that then exits
                # at once, taking the store with it, is not missed), in slices between checks
                self.store.wait(list(missing.values()), timedelta(_INIT_POLL_S))
                return
            except DistStoreError:  # this slice ran out
                pass
            except DistError as exc:  # the store lives in rank 0's process
                raise self._store_lost(missing, what, exc) from exc
            try:
                missing = {r: k for r, k in missing.items() if not self.store.check([k])}
                if missing:
                    self._raise_if_failed()
            except DistError as exc:
                raise self._store_lost(missing, what, exc) from exc
            if not missing:
                return
            dead = [r for r in missing if r in self._pids and not pid_alive(self._pids[r])]
            if dead:
                raise RuntimeError(
                    f"ipc: rank {dead[0]} (pid {self._pids[dead[0]]}) died during init_transfer_group "
                    f"before it could {what}; rank {self.rank} gives up (its segments are reaped by "
                    "the next init on this host)"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"ipc: rank(s) {sorted(missing)} did not {what} within {self.timeout_s:.1f}s "
                    f"(init_transfer_group on rank {self.rank})"
                )
            time.sleep(_INIT_POLL_S)

    def _store_lost(self, missing: dict[int, str], what: str, exc: Exception) -> RuntimeError:
        return RuntimeError(
            f"ipc: rank {self.rank} lost the group's rendezvous store (hosted by rank 0) while "
            f"waiting for rank(s) {sorted(missing)} to {what}: {exc}"
        )

    def _join_peer(self, peer: int) -> None:
        key = f"ipc/rank{peer}"
        self._await_keys({peer: key}, "join the transfer group")
        info = json.loads(self.store.get(key))
        self._pids[peer] = int(info["pid"])
        try:
            self._peer_bells[peer] = SharedSegment(info["bell"], 4096, create=False)
        except SegmentError as exc:
            self._raise_if_failed()
            if not pid_alive(self._pids[peer]):
                raise RuntimeError(
                    f"ipc: rank {peer} (pid {self._pids[peer]}) died during init_transfer_group before "
                    f"rank {self.rank} could open its doorbell segment"
                ) from exc
            raise ValueError(
                f"ipc backend: rank {peer}'s shared segment {info['bell']!r} is not visible from rank "
                f"{self.rank}; every rank must run on one host with one /dev/shm (use gloo otherwise)"
            ) from exc

    # --- doorbells and bounded waits ------------------------------------------------------------

    def runner(self, role: str, peers: list[int], steps: list[tuple]) -> object:
        """A native runner (csrc/shm/runner.cpp) of ``steps`` over this group's channels: each
        step is (index into ``peers``, slot control address, slot address, tag, nbytes, copy
        descriptors), in execution order. Its waits behave like `wait_for` (bounded, liveness
        and abort checks every ``_SLICE_S``, this group's `close` seen)."""
        watch = [
            (p, self._pids[p], self._peer_bells[p].base,
             [c.aborted_address for c in self._channels.values() if c.peer == p])
            for p in peers
        ]
        return native().shm.Runner(
            role, self.rank, watch, steps, self._bell.base, self._bell.base + _CLOSED_AT, _SLICE_S
        )

    def ring(self, peer: int) -> None:
        """Wake ``peer`` (after a store it waits for)."""
        native().shm.bell_ring(self._peer_bells[peer].base)

    def wait_for(self, ready: Callable[[], bool], peer: int, timeout_s: float, what: str) -> None:
        """Sleep on this rank's doorbell until ``ready()`` holds; TimeoutError after ``timeout_s``,
        RuntimeError when ``peer`` died or aborted, or this group was closed."""
        shm, bell = native().shm, self._bell.base
        deadline = time.monotonic() + timeout_s
        quiet = False  # the last sleep ran its whole slice: time to look at the peer
        while True:
            seen = shm.bell_read(bell)
            if ready():
                return
            if self._closed:
                raise RuntimeError(f"ipc transfer group was closed or aborted while waiting for {what}")
            if quiet:
                self._check_peer_alive(peer, what)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"ipc: waiting for {what} from rank {peer} timed out after {timeout_s:.1f}s"
                )
            quiet = not shm.bell_wait(bell, seen, min(_SLICE_S, left))

    def _check_peer_alive(self, peer: int, what: str) -> None:
        if any(c.peer == peer and c.peer_aborted for c in self._channels.values()):
            raise RuntimeError(
                f"ipc: rank {peer} aborted the transfer while rank {self.rank} waited for {what}"
            )
        if not pid_alive(self._pids[peer]):
            raise RuntimeError(
                f"ipc: rank {peer} (pid {self._pids[peer]}) died while rank {self.rank} waited for {what}"
            )

    # --- channels -------------------------------------------------------------------------------

    def _channel_key(self, src: int, dst: int, name: str) -> str:
        return f"ipc/chan/{name}/{src}_{dst}"

    def channel(
        self, peer: int, role: str, name: str, slots: int, slot_bytes: int, *, wait: bool = True
    ) -> Channel | None:
        """The (this rank, ``peer``) channel ``name``: the receiver creates it with ``slots`` slots
        of ``slot_bytes``; the sender maps it (waiting up to the group's timeout when ``wait``,
        else returning None while it does not exist yet) and checks the geometry it expects."""
        check_peer(self, peer, self._closed)
        key = (role, peer, name)
        with self._lock:
            if key in self._channels:
                return self._channels[key]
            if slots < 1 or slot_bytes < 1:
                raise ValueError(
                    f"ipc channel {name!r}: slots ({slots}) and slot_bytes ({slot_bytes}) must be positive"
                )
            slot_bytes = (int(slot_bytes) + 63) // 64 * 64
            if role == "recv":
                chan = self._create_channel(peer, name, int(slots), slot_bytes)
            elif role == "send":
                chan = self._open_channel(peer, name, wait)
                if chan is None:
                    return None
                if (chan.slots, chan.slot_bytes) != (slots, slot_bytes):
                    raise ValueError(
                        f"ipc channel {name!r} to rank {peer}: the receiver made {chan.slots} slots of "
                        f"{chan.slot_bytes} bytes, this sender expects {slots} of {slot_bytes}"
                    )
            else:
                raise ValueError(f"role must be 'send' or 'recv', got {role!r}")
            self._channels[key] = chan
            return chan

    def _create_channel(self, peer: int, name: str, slots: int, slot_bytes: int) -> Channel:
        size = _page_round(_HEADER + slots * _CTL) + slots * slot_bytes
        seg = self._segment("chan", f"{peer}_{self.rank}_{name}", size)
        words = seg.tensor[:_HEADER].view(torch.int64)
        words[1], words[2] = slots, slot_bytes
        words[0] = _MAGIC
        self.store.set(self._channel_key(peer, self.rank, name), json.dumps({"name": seg.name, "size": size}))
        return Channel(self, seg, peer, "recv", name)

    def _open_channel(self, peer: int, name: str, wait: bool) -> Channel | None:
        key = self._channel_key(self.rank, peer, name)
        if not wait and not self.store.check([key]):
            return None
        self.wait_for(lambda: self.store.check([key]), peer, self.timeout_s, f"channel {name!r}")
        info = json.loads(self.store.get(key))
        try:
            seg = SharedSegment(info["name"], int(info["size"]), create=False)
        except SegmentError as exc:
            raise RuntimeError(
                f"ipc: channel {name!r} of rank {peer} is gone before rank {self.rank} mapped it "
                "(the receiver exited or closed its group)"
            ) from exc
        seg.unlink()  # both sides map it now: nothing is left to leak
        return Channel(self, seg, peer, "send", name)

    # --- plain isend / irecv --------------------------------------------------------------------
    # Chunks go through the native copy the executor uses (prefetching reads; the receiver's
    # copy out streams past the caches), so `raw` over ipc measures the best this channel does.

    def _post(self, role: str, tensor: torch.Tensor, peer: int, tag: int) -> _IpcPending:
        check_peer(self, peer, self._closed)
        if not tensor.is_contiguous():
            raise ValueError("transfer buffers must be contiguous")
        if tensor.device.type != "cpu":
            raise ValueError(f"the ipc backend moves CPU tensors; got one on {tensor.device}")
        data = tensor.view(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        chunks = max(1, -(-data.numel() // self.chunk_bytes))
        stream = _Stream(role, peer, int(tag), data, chunks)
        with self._lock:
            if role == "recv":  # the receiver creates the channel, so a sender can find it
                self.channel(peer, "recv", "p2p", CHUNK_SLOTS, self.chunk_bytes)
            self._streams.setdefault((role, peer), deque()).append(stream)
            self._progress()
        return _IpcPending(self, stream)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> _IpcPending:
        """Start sending ``tensor`` to ``peer`` (progresses while this rank waits on any transfer)."""
        return self._post("send", tensor, peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> _IpcPending:
        """Start receiving into ``tensor`` from ``peer``; sends and receives of a pair match in
        posting order, and a tag or size that differs from what the sender posted raises."""
        return self._post("recv", tensor, peer, tag)

    def join_current_stream(self) -> None:
        """Nothing to do: CPU tensors, and a wait returns once the bytes are in place."""

    def _progress(self) -> bool:
        """Move every pending stream as far as it can go without waiting; True if any moved."""
        moved = False
        for queue in self._streams.values():
            while queue:
                stream = queue[0]
                try:
                    moved |= self._advance(stream)
                except (RuntimeError, ValueError) as exc:
                    stream.error = exc
                if stream.done or stream.error is not None:
                    queue.popleft()
                    continue
                break
        return moved

    def _advance(self, s: _Stream) -> bool:
        chan = self.channel(s.peer, s.role, "p2p", CHUNK_SLOTS, self.chunk_bytes, wait=False)
        if chan is None:
            return False
        key, moved = (s.role, s.peer), False
        while not s.done:
            n = self._next_chunk.get(key, 0)
            a = s.done_chunks * self.chunk_bytes
            b = min(s.data.numel(), a + self.chunk_bytes)
            if s.role == "send":
                if not chan.can_acquire(n):
                    break
                _copy_bytes(chan.slot(n % chan.slots), s.data, a, b - a, streaming=False)
                chan.publish(n, b - a, s.tag, s.data.numel())
            else:
                if not chan.is_ready(n):
                    break
                got, tag = chan.header(n)
                total = chan.total(n)
                if tag != s.tag or total != s.data.numel():
                    raise ValueError(
                        f"ipc: rank {s.peer} sent message tag {tag} of {total} bytes where rank {self.rank} "
                        f"expected tag {s.tag} of {s.data.numel()} bytes (sends and receives of a pair "
                        "must match in posting order and size)"
                    )
                _copy_bytes(s.data[a:], got, 0, b - a, streaming=True)
                chan.release(n)
            self._next_chunk[key] = n + 1
            s.done_chunks += 1
            moved = True
        return moved

    def complete(self, stream: _Stream, timeout_s: float) -> None:
        """Progress until ``stream`` is done; raise what failed it."""

        def finished() -> bool:
            with self._lock:
                self._progress()
            return stream.done or stream.error is not None

        verb = "sending" if stream.role == "send" else "receiving"
        self.wait_for(finished, stream.peer, timeout_s, f"{verb} message tag {stream.tag}")
        if stream.error is not None:
            raise RuntimeError(str(stream.error)) from stream.error

    # --- teardown -------------------------------------------------------------------------------

    def abort(self) -> None:
        """Mark every channel dead (waiting peers raise) and make the group unusable."""
        if self._closed:
            return
        for chan in self._channels.values():
            with contextlib.suppress(Exception):
                chan.mark_aborted()
                self.ring(chan.peer)
        self.close()

    def close(self) -> None:
        """Leave the group: unmap the channels (unlinking any a sender never opened)."""
        if self._closed:
            return
        self._closed = True
        native().shm.store(self._bell.base + _CLOSED_AT, 1)  # native waits of this process stop too
        native().shm.bell_ring(self._bell.base)
        for chan in self._channels.values():
            chan.segment.unlink()
        self._channels.clear()
        self._streams.clear()
