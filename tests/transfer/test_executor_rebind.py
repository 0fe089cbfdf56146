"""Issue 36 item 1: every round sends what the sender's source holds in that round, over real
gloo and ipc groups. The sender hands `Executor.run` the round's tensors: new objects (a
replaced dict), the same objects changed in place, and finally a tensor that no longer fits
the plan, which fails the round on both sides before a byte moves, naming the parameter."""

from __future__ import annotations

import time

import pytest
import torch
from _dist import run_world
from _jobs import free_port
from test_executor import check_pieces, layout, local_tensors

from awex_fast.plan import build_plan
from awex_fast.transfer import Executor, wire_buckets
from awex_fast.transport import TransferError, init_transfer_group


def _rebind_worker(rank, world_size, port, backend):
    """Rank 0 infers, rank 1 trains. Rounds 1-2: new tensors each round; round 3: the round-2
    tensors changed in place to round 3's values; round 4: one tensor too short."""
    train, infer = layout(1, 1, "float32", "bfloat16", 1)
    plan = build_plan(train, infer, bucket_bytes=512)
    sender = rank == 1
    metas, dtype = (train, torch.float32) if sender else (infer, torch.bfloat16)
    group = init_transfer_group(backend, rank, world_size, "127.0.0.1", port, timeout=30)
    out: dict = {"rounds": []}
    try:
        tensors = local_tensors(metas, rank, dtype, 0 if sender else None)
        ex = Executor(wire_buckets(plan.for_rank(rank)), tensors, group, digest=plan.digest(), timeout_s=20)
        ex.handshake()
        for version in (1, 2, 3):
            if sender and version < 3:
                tensors = local_tensors(metas, rank, dtype, version)  # new objects, new memory
            elif sender:
                for name, t in local_tensors(metas, rank, dtype, version).items():
                    tensors[name].copy_(t)  # same objects, new values
            stats = ex.run(version, tensors if sender else None)
            record = {"version": version, "rebound": stats["rebound"]}
            if not sender:
                record["bad"] = check_pieces(metas, rank, tensors, version)
            out["rounds"].append(record)
        if sender:
            name = max(tensors, key=lambda n: tensors[n].dim())
            tensors = dict(tensors, **{name: tensors[name][:-1].clone()})
            out["short"] = name
        t0 = time.perf_counter()
        try:
            ex.run(4, tensors if sender else None)
            out["round4"] = None
        except TransferError as exc:
            out["round4"] = str(exc)
        out["round4_s"] = time.perf_counter() - t0
        return out
    finally:
        group.abort()


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_each_round_sends_the_tensors_the_source_holds_now(backend):
    receiver, sender = run_world(_rebind_worker, 2, free_port(), backend, backend=None, timeout=180)
    assert [r["bad"] for r in receiver["rounds"]] == [[], [], []], receiver["rounds"]
    # new objects rebuild the copy programs; the same objects (changed in place) keep them
    assert [r["rebound"] for r in sender["rounds"]] == [True, True, False], sender["rounds"]
    assert sender["round4"] is not None and repr(sender["short"]) in sender["round4"], sender["round4"]
    assert "do not match the plan" in sender["round4"], sender["round4"]
    assert receiver["round4"] is not None, "the receiver reported a round whose sender refused it"
    assert receiver["round4_s"] < 15, receiver["round4_s"]
