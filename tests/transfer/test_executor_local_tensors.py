"""Issue 22 item 1: a local tensor that does not fit its metadata (a receiver's 64x30 for a 64x32
parameter, a sender's 4 rows short, the wrong dtype) is refused when the executor is built,
naming the rank and the parameter, before any byte moves; over real gloo and ipc groups."""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from _jobs import free_port
from test_executor import layout, local_tensors

from awex_fast.plan import build_plan
from awex_fast.transfer import Executor, wire_buckets
from awex_fast.transport import init_transfer_group


def _bad_tensor_worker(rank, world_size, port, backend, bad_rank, how):
    """Rank 0 infers, rank 1 trains; ``bad_rank`` gets one tensor spoiled by ``how``."""
    train, infer = layout(1, 1, "float32", "bfloat16", 1)
    plan = build_plan(train, infer, bucket_bytes=512)
    is_train = rank == 1
    tensors = local_tensors(train if is_train else infer, rank,
                            torch.float32 if is_train else torch.bfloat16, 0 if is_train else None)
    name = max(tensors, key=lambda n: tensors[n].dim())  # a 2-D weight
    if rank == bad_rank:
        t = tensors[name]
        tensors[name] = {"cols": t[:, :-2], "rows": t[:-4], "dtype": t.to(torch.float16)}[how]
    group = init_transfer_group(backend, rank, world_size, "127.0.0.1", port, timeout=30)
    try:
        Executor(wire_buckets(plan.for_rank(rank)), tensors, group, digest=plan.digest())
        return {"error": None, "name": name}
    except ValueError as exc:
        return {"error": str(exc), "name": name, "shape": list(tensors[name].shape)}
    finally:
        group.abort()


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
@pytest.mark.parametrize(("bad_rank", "how"), [(0, "cols"), (1, "rows"), (0, "dtype")])
def test_local_tensor_that_does_not_fit_its_metadata_is_refused(backend, bad_rank, how):
    out = run_world(_bad_tensor_worker, 2, free_port(), backend, bad_rank, how, backend=None, timeout=120)
    good, bad = out[1 - bad_rank], out[bad_rank]
    assert good["error"] is None, good
    assert bad["error"] is not None, bad
    assert f"rank {bad_rank}: parameter {bad['name']!r}" in bad["error"]
    assert f"but this rank's is {tuple(bad['shape'])}" in bad["error"]
    if how == "dtype":
        assert "needs a local bfloat16 tensor" in bad["error"] and "float16" in bad["error"]
