"""The ipc transfer backend: POSIX shared memory between real processes of this host."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _dist import run_world
from _jobs import free_port

from awex_fast.transport import init_transfer_group


def _shm_names(token: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if token in n]


def _exchange(rank, world_size, port, numel):
    """Every rank sends a distinct tensor to every other rank at once, in several chunks."""
    group = init_transfer_group("ipc", rank, world_size, "127.0.0.1", port, timeout=60)
    group.chunk_bytes = 1 << 16  # force many chunks (and slot reuse) per message
    sends, recvs = [], {}
    for peer in range(world_size):
        if peer == rank:
            continue
        payload = torch.arange(numel, dtype=torch.float32) + 1000 * rank + peer
        sends.append(group.isend(payload, peer, 3))
        recvs[peer] = (torch.empty(numel), None)
    for peer, (buf, _) in recvs.items():
        recvs[peer] = (buf, group.irecv(buf, peer, 3))
    for peer, (buf, pending) in recvs.items():
        pending.wait(30)
        want = torch.arange(numel, dtype=torch.float32) + 1000 * peer + rank
        assert torch.equal(buf, want), f"rank {rank} got wrong bytes from {peer}"
    for s in sends:
        s.wait(30)
    # a second round on the same channels (chunk counters continue) and an empty message
    if rank == 0:
        group.isend(torch.full((5,), 7.0), 1, 9).wait(30)
        group.isend(torch.empty(0), 1, 10).wait(30)
    elif rank == 1:
        got = torch.empty(5)
        group.irecv(got, 0, 9).wait(30)
        assert torch.equal(got, torch.full((5,), 7.0))
        group.irecv(torch.empty(0), 0, 10).wait(30)
    # every rank is done with every stream (so every sender has mapped its channel) before any looks
    group.store.add("finished", 1)
    while group.store.add("finished", 0) < world_size:
        time.sleep(0.01)
    leftovers = _shm_names(group._token)
    # rank 0 hosts the store: it stays until every other rank is past its last store call
    group.store.add("listed", 1)
    while rank == 0 and group.store.add("listed", 0) < world_size:
        time.sleep(0.01)
    group.close()
    return {"leftovers": leftovers}


def test_ipc_all_to_all_bit_exact_and_leaves_no_segments():
    out = run_world(_exchange, 3, free_port(), 100_003, backend=None, timeout=120)
    # every segment (doorbells, and each pair's p2p channel) was unlinked once its peer mapped it
    assert all(len(o["leftovers"]) == 0 for o in out), out


def _mismatch(rank, world_size, port):
    group = init_transfer_group("ipc", rank, world_size, "127.0.0.1", port, timeout=30)
    if rank == 0:
        group.isend(torch.zeros(10), 1, 4).wait(30)
        return {"msg": ""}
    with pytest.raises(RuntimeError) as info:
        group.irecv(torch.empty(12), 0, 4).wait(30)
    group.close()
    return {"msg": str(info.value)}


def test_ipc_size_mismatch_raises_naming_both_sizes():
    out = run_world(_mismatch, 2, free_port(), backend=None, timeout=90)
    assert "40 bytes" in out[1]["msg"] and "48 bytes" in out[1]["msg"], out[1]["msg"]


def _dead_peer(rank, world_size, port):
    group = init_transfer_group("ipc", rank, world_size, "127.0.0.1", port, timeout=30)
    if rank == 1:
        return {}  # the process ends without a word, in the middle of the protocol
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 .* died"):
        group.irecv(torch.empty(4), 1, 0).wait(20.0)
    return {"elapsed": time.monotonic() - t0}


def test_ipc_dead_peer_is_seen_long_before_the_timeout():
    out = run_world(_dead_peer, 2, free_port(), backend=None, timeout=90)
    assert out[0]["elapsed"] < 5


def _abort(rank, world_size, port):
    group = init_transfer_group("ipc", rank, world_size, "127.0.0.1", port, timeout=30)
    if rank == 1:
        chan = group.channel(0, "recv", "x", 2, 64)  # make the pair's channel, then give up
        assert chan is not None
        group.store.set("made", "1")
        group.store.wait(["waiting"])
        time.sleep(0.3)
        group.abort()
        return {"msg": ""}
    group.store.wait(["made"])
    chan = group.channel(1, "send", "x", 2, 64)
    chan.publish(0, 8, 0)
    chan.publish(1, 8, 1)
    group.store.set("waiting", "1")
    with pytest.raises(RuntimeError) as info:
        chan.acquire(2, 20.0)  # the receiver never frees slot 0; it aborts instead
    return {"msg": str(info.value)}


def test_ipc_abort_wakes_the_waiting_peer():
    out = run_world(_abort, 2, free_port(), backend=None, timeout=90)
    assert "aborted" in out[0]["msg"]


def _bad_input(rank, world_size, port):
    group = init_transfer_group("ipc", rank, world_size, "127.0.0.1", port, timeout=30)
    other = 1 - rank
    try:
        with pytest.raises(ValueError, match="contiguous"):
            group.isend(torch.zeros(4, 4).t(), other, 0)
        with pytest.raises(ValueError, match=f"peer {rank} is not another rank"):
            group.isend(torch.zeros(4), rank, 0)
        with pytest.raises(ValueError, match="peer 3"):
            group.irecv(torch.zeros(4), 3, 0)
        with pytest.raises(ValueError, match="slot_bytes"):
            group.channel(other, "recv", "bad", 2, 0)
    finally:
        group.close()
    with pytest.raises(RuntimeError, match="closed"):
        group.isend(torch.zeros(4), other, 0)
    return {}


def test_ipc_refuses_bad_buffers_peers_and_a_closed_group():
    run_world(_bad_input, 2, free_port(), backend=None, timeout=60)


def _runner_world(rank, world_size, port):
    """The native runner against a hand-driven peer: it lands a good message, names a message
    the peer published in its place, gives up at its timeout, and stops when its group closes."""
    import threading

    from awex_fast.transfer import boxcopy as afc

    group = init_transfer_group("ipc", rank, world_size, "127.0.0.1", port, timeout=30)
    if rank == 1:  # the hand-driven sender
        group.store.wait(["made"])
        chan = group.channel(0, "send", "r", 2, 64)
        chan.slot(0)[:16].copy_(torch.arange(16, dtype=torch.uint8))
        chan.publish(0, 16, 0)  # what the runner expects: message 0 of 16 bytes
        chan.slot(1)[:8].fill_(1)
        chan.publish(1, 8, 5)  # the runner expects message 1 of 16 bytes
        group.store.wait(["done"])
        return {}
    chan = group.channel(1, "recv", "r", 2, 64)
    group.store.set("made", "1")
    out = torch.zeros(2, 16, dtype=torch.uint8)
    steps = []
    for tag in (0, 1):
        prog = afc.scatter_program(chan.slot(tag), [0], torch.uint8, [out[tag]])
        steps.append((0, chan.control_address(tag), chan.slot(tag).data_ptr(), tag, 16, prog.desc))
    status, failed, detail, times, _ = group.runner("recv", [1], steps).run([0], 10.0, False)
    first = {"status": status, "failed": failed, "detail": detail, "row0": out[0].tolist()}
    first["times0"] = times[0].tolist()  # message 0: wait start <= arrival <= unpacked
    # nothing is published for chunk 2: a short timeout
    late = steps[:1]
    t0 = time.monotonic()
    status, _, detail, _, _ = group.runner("recv", [1], late).run([2], 0.3, False)
    timed_out = {"status": status, "detail": detail, "elapsed": time.monotonic() - t0}
    # the group closes (from another thread) while the runner waits
    threading.Timer(0.3, group.close).start()
    t0 = time.monotonic()
    status, _, detail, _, _ = group.runner("recv", [1], late).run([2], 20.0, False)
    closed = {"status": status, "detail": detail, "elapsed": time.monotonic() - t0}
    group.store.set("done", "1")
    return {"first": first, "timed_out": timed_out, "closed": closed}


def test_native_runner_names_mismatches_timeouts_and_a_closed_group():
    out = run_world(_runner_world, 2, free_port(), backend=None, timeout=90)[0]
    first = out["first"]
    assert first["row0"] == list(range(16))  # message 0 landed before message 1 was refused
    assert first["status"] == 5 and first["failed"] == 1, first
    t0, t1, t2 = first["times0"]
    assert 0 < t0 <= t1 <= t2
    assert "expected message 1 of 16 bytes" in first["detail"] and "message 5 of 8 bytes" in first["detail"]
    assert out["timed_out"]["status"] == 1 and "timed out after 0.3s" in out["timed_out"]["detail"]
    assert out["timed_out"]["elapsed"] < 5
    assert out["closed"]["status"] == 4 and "closed" in out["closed"]["detail"]
    assert out["closed"]["elapsed"] < 5
