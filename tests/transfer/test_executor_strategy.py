"""The executor runs the strategy its transfer group declares (`TransferGroup.strategy`): staged
over gloo (staging slots, zero-copy where a box allows), shared slots over ipc (every message
packed into the receiver's slots); both move the same update bit-exactly (oracle: test_executor's
global tensors, sliced per rank)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from _jobs import free_port
from test_executor import check_pieces, layout, local_tensors

from awex_fast.plan import build_plan
from awex_fast.transfer import Executor, wire_buckets
from awex_fast.transfer.shared_slots import SharedSlotMessages
from awex_fast.transfer.staged import StagedMessages
from awex_fast.transport import SHARED_SLOTS, STAGED, init_transfer_group
from awex_fast.transport.base import STRATEGIES
from awex_fast.transport.ipc import IpcTransferGroup
from awex_fast.transport.nccl import NativeNcclGroup
from awex_fast.transport.torch_dist import TorchTransferGroup


def _strategy_worker(rank, world_size, port, backend):
    """Rank 0 infers (bfloat16), rank 1 trains (float32); one update, checked against the oracle."""
    train, infer = layout(1, 1, "float32", "bfloat16", 1)
    plan = build_plan(train, infer, bucket_bytes=1 << 20)
    is_train = rank == 1
    metas = train if is_train else infer
    dtype = torch.float32 if is_train else torch.bfloat16
    tensors = local_tensors(metas, rank, dtype, 0 if is_train else None)
    group = init_transfer_group(backend, rank, world_size, "127.0.0.1", port, timeout=60)
    # a large solo op whose box is contiguous in the wire dtype: zero-copy where the strategy allows
    ex = Executor(wire_buckets(plan.for_rank(rank)), tensors, group, digest=plan.digest(), solo_bytes=1024)
    ex.handshake()
    ex.run(0)
    group.close()
    return {
        "declared": group.strategy,
        "strategy": ex.strategy.name,
        "kind": type(ex.strategy).__name__,
        "shared": ex.shared,
        "zero_copy": ex.zero_copy_fraction(),
        "staging": ex.staging_bytes,
        "bad": [] if is_train else check_pieces(infer, rank, tensors, 0),
        "messages": len(ex.trace),
    }


@pytest.mark.parametrize(
    ("backend", "strategy", "kind"),
    [("gloo", STAGED, StagedMessages.__name__), ("ipc", SHARED_SLOTS, SharedSlotMessages.__name__)],
)
def test_executor_runs_the_strategy_its_group_declares(backend, strategy, kind):
    out = run_world(_strategy_worker, 2, free_port(), backend, backend=None, timeout=120)
    for o in out:
        assert (o["declared"], o["strategy"], o["kind"]) == (strategy, strategy, kind), o
        assert o["shared"] == (strategy == SHARED_SLOTS)
        assert o["bad"] == [] and o["messages"] > 0
    infer, train = out
    if strategy == STAGED:
        # the receiver's float32 -> bfloat16 cast happens on the sender: bfloat16 boxes of the
        # receiver are contiguous, so some of its messages land in parameter memory directly
        assert infer["zero_copy"] > 0
    else:
        # every message goes through the receiver's shared slots, which are its only staging
        assert infer["zero_copy"] == train["zero_copy"] == 0.0
        assert infer["staging"] > 0 and train["staging"] == 0


def test_every_backend_declares_a_known_strategy():
    assert TorchTransferGroup.strategy == STAGED
    assert NativeNcclGroup.strategy == STAGED
    assert IpcTransferGroup.strategy == SHARED_SLOTS
    assert callable(IpcTransferGroup.channel) and callable(IpcTransferGroup.runner)  # a SharedSlotGroup
    assert set(STRATEGIES) == {STAGED, SHARED_SLOTS}


def test_a_group_declaring_an_unknown_strategy_is_refused():
    group = init_transfer_group("gloo", 0, 1, "127.0.0.1", free_port(), timeout=30)
    try:
        group.strategy = "carrier-pigeon"
        with pytest.raises(ValueError, match="declares strategy 'carrier-pigeon'"):
            Executor([], {}, group)
    finally:
        group.close()
