"""A round's outcome reaches its senders: a receiver that finds a message corrupted (``verify``)
refuses the version and tells its senders, so no sender reports success for a version that did
not land (issue #22, item 6). The groups are real gloo groups; on the receiver one is wrapped to
flip a byte of a data message after it arrived, the corruption loopback TCP never produces."""

from __future__ import annotations

import torch
from _dist import run_world
from _jobs import free_port
from test_executor import check_pieces, layout, local_tensors

from awex_fast.plan import build_plan
from awex_fast.transfer import Executor, wire_buckets
from awex_fast.transport import TransferError, init_transfer_group


class _FlipAfterArrival:
    """The received bytes of data message ``tag`` have one bit flipped once they arrived."""

    def __init__(self, pending, wire: torch.Tensor) -> None:
        self.pending, self.wire = pending, wire

    def wait(self, timeout_s: float) -> None:
        self.pending.wait(timeout_s)
        raw = self.wire.view(torch.uint8).view(-1)
        raw[0] ^= 1


class _CorruptingGroup:
    """A real transfer group whose receives of data message 0 arrive with one bit flipped."""

    def __init__(self, group) -> None:
        self._group = group

    def __getattr__(self, name: str):
        return getattr(self._group, name)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int):
        pending = self._group.irecv(tensor, src, tag)
        return _FlipAfterArrival(pending, tensor) if tag == 0 else pending


def _round_worker(rank: int, world_size: int, port: int, corrupt: bool, leaver: int | None = None) -> dict:
    n_infer = 1
    train, infer = layout(n_infer, world_size - n_infer, "float32", "bfloat16", 1)
    plan = build_plan(train, infer, bucket_bytes=1 << 20)
    is_train = rank >= n_infer
    tensors = local_tensors(train if is_train else infer, rank,
                            torch.float32 if is_train else torch.bfloat16, 0 if is_train else None)
    group = init_transfer_group("gloo", rank, world_size, "127.0.0.1", port, timeout=30)
    if corrupt and not is_train:
        group = _CorruptingGroup(group)
    ex = Executor(wire_buckets(plan.for_rank(rank)), tensors, group, digest=plan.digest(), verify=True)
    ex.handshake()
    out: dict = {"error": None, "peer": None}
    if rank == leaver:  # drops out of the round: its connections close, as a dead process's do
        group.abort()
        return {"left": True}
    try:
        ex.run(1)
    except TransferError as exc:
        out["error"], out["peer"] = str(exc), exc.peer
    out["version"] = ex.version
    if not is_train and out["error"] is None:
        out["bad"] = check_pieces(infer, rank, tensors, 0)
    group.close()
    return out


def test_a_round_the_receiver_refuses_fails_on_every_sender_too():
    out = run_world(_round_worker, 3, free_port(), True, backend=None, timeout=120)
    receiver, senders = out[0], out[1:]
    assert receiver["version"] is None and "checksum mismatch" in receiver["error"], receiver
    for rank, sender in enumerate(senders, start=1):
        # before the outcome message, each sender returned success here for a version that
        # never landed on rank 0
        assert sender["version"] is None, (rank, sender)
        assert sender["peer"] == 0, (rank, sender)
        # it heard "did not land", or lost the receiver mid-closing (it aborted on the mismatch)
        assert ("receiver rank 0 reports that version 1 did not land" in sender["error"]
                or "closing checksum list or outcome" in sender["error"]), (rank, sender)
        assert "version=1" in sender["error"], (rank, sender)


def test_a_healthy_round_lands_everywhere_with_the_outcome_exchanged():
    out = run_world(_round_worker, 3, free_port(), False, backend=None, timeout=120)
    assert [o["error"] for o in out] == [None] * 3, out
    assert [o["version"] for o in out] == [1, 1, 1]
    assert out[0]["bad"] == []


def test_a_rank_that_never_talked_to_the_failed_one_still_names_it():
    # Rank 2 (a sender) drops out. Only receiver 0 talks to it; sender 1 talks to rank 0 alone,
    # yet its error names rank 2 through the round's first failure, recorded by rank 0.
    out = run_world(_round_worker, 3, free_port(), False, 2, backend=None, timeout=120)
    receiver, sender = out[0], out[1]
    assert receiver["version"] is None and receiver["peer"] == 2, receiver
    assert "parameters=" in receiver["error"] and "version=1" in receiver["error"], receiver
    assert sender["version"] is None and sender["peer"] == 0, sender
    assert "the round's first failure: rank 0:" in sender["error"], sender
    assert "peer=2" in sender["error"].split("the round's first failure")[1], sender
