"""GPU-only transport checks (one GPU: NCCL cannot put two ranks on it, so self-send)."""

from __future__ import annotations

import pytest
import torch

import awex_fast as af

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not af.build_info()["cuda"], reason="awex_fast built without CUDA"),
]


def test_native_nccl_loads_and_self_sends():
    from _jobs import free_port

    from awex_fast.transport import init_transfer_group
    from awex_fast.transport.nccl import load_nccl

    info = load_nccl()
    assert info["version"] >= 20400
    group = init_transfer_group("native-nccl", 0, 1, "127.0.0.1", free_port(), timeout=60)
    src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    group.post_group([(True, src, 0), (False, dst, 0)]).wait(30)
    group.join_current_stream()
    assert torch.equal(src, dst)
    group.close()
