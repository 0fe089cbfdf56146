"""GPU-only transport checks (one GPU: NCCL cannot put two ranks on it, so self-send)."""

from __future__ import annotations

import time

import pytest
import torch

import awex_fast as af

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not af.build_info()["cuda"], reason="awex_fast built without CUDA"),
]

# GPU clock cycles for torch.cuda._sleep: about 1 s at an H100/H200's ~2 GHz, far longer than the
# short waits below that must time out, far shorter than the ones that must not.
_BUSY_CYCLES = 2_000_000_000


def _group():
    from _jobs import free_port

    from awex_fast.transport import init_transfer_group

    return init_transfer_group("native-nccl", 0, 1, "127.0.0.1", free_port(), timeout=60)


def _self_exchange(group, src: torch.Tensor, dst: torch.Tensor):
    return group.post_group([(True, src, 0), (False, dst, 0)])


def test_native_nccl_loads_and_self_sends():
    from awex_fast.transport.nccl import load_nccl

    info = load_nccl()
    assert info["version"] >= 20400
    group = _group()
    src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    dst = torch.full_like(src, -1.0)  # not empty_like: a recycled block could already hold src
    _self_exchange(group, src, dst).wait(30)
    group.join_current_stream()
    assert torch.equal(src, dst)
    group.close()


def test_native_nccl_waits_for_the_producer_stream_then_completes():
    """The group is ordered after the caller's stream (what packed the bucket): while that stream
    is busy the exchange must not finish (a short wait times out), and it must carry what the
    stream wrote last."""
    group = _group()
    try:
        src = torch.zeros(1 << 16, dtype=torch.float32, device="cuda")
        dst = torch.full_like(src, -1.0)
        _self_exchange(group, src, dst).wait(30)  # connect first: later posts only enqueue
        group.join_current_stream()
        torch.cuda.synchronize()
        torch.cuda._sleep(_BUSY_CYCLES)  # the producer stream is busy for about a second
        src.fill_(7.0)  # queued behind it: the send must see it
        pending = _self_exchange(group, src, dst)
        with pytest.raises(TimeoutError):
            pending.wait(0.05)
        pending.wait(60)
        group.join_current_stream()
        assert torch.equal(dst, torch.full_like(src, 7.0))
    finally:
        group.close()


def test_native_nccl_abort_after_a_timeout_is_bounded_and_final():
    """The executor's failure path: a wait times out, abort() (ncclCommAbort) returns in bounded
    time, the pending operation never reports success afterwards, the group refuses new work, and
    the device stays usable."""
    group = _group()
    src = torch.ones(1 << 16, dtype=torch.float32, device="cuda")
    dst = torch.zeros_like(src)
    _self_exchange(group, src, dst).wait(30)
    torch.cuda.synchronize()
    torch.cuda._sleep(_BUSY_CYCLES)
    pending = _self_exchange(group, src, dst)
    with pytest.raises(TimeoutError):
        pending.wait(0.05)
    t0 = time.monotonic()
    group.abort()
    assert time.monotonic() - t0 < 30
    with pytest.raises(RuntimeError, match="aborted"):
        pending.wait(1)
    with pytest.raises(RuntimeError, match="closed or aborted"):
        _self_exchange(group, src, dst)
    torch.cuda.synchronize()  # no sticky CUDA error left behind
    assert torch.equal(src * 2, torch.full_like(src, 2.0))
    group.close()  # a no-op after abort
