"""Trainer-side FP8 quantization (awex_fast.vllm.fp8_sender) over real gloo ranks: DTensor shards
that cut through 128 x 128 blocks (uneven FSDP2-like row shards, TP-like column shards, both on
a 2-D mesh) are quantized where they live, with the block amax agreed by one all-reduce; the
pieces of every rank, put together, equal vLLM's ``per_block_cast_to_fp8`` of the full tensor
byte for byte, scales included, and the ranks' metadata merges with no gap or overlap."""

from __future__ import annotations

import pytest
import torch
from _dist import run_world

pytest.importorskip("vllm", reason="awex_fast.vllm and the oracle need vLLM")

from vllm.utils.deep_gemm import per_block_cast_to_fp8

from awex_fast.meta import ParameterMeta, ShardMeta, merge_metas

SHAPE = (512, 300)  # 3 row shards: 171 / 171 / 170; 300 columns: a partial last block


def _full(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 1, SHAPE[1])


def _quantize_world(rank: int, world_size: int, mesh_shape: list[int], placements: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from awex_fast.layouts import metas_from_dtensors
    from awex_fast.sync.adapter_base import local_tensor
    from awex_fast.vllm.fp8_sender import QuantizingSource
    from awex_fast.vllm.trainer_group import all_reduce_max

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    kinds = {"rows": Shard(0), "cols": Shard(1), "replicate": Replicate()}
    named = {"w": distribute_tensor(_full(3), mesh, [kinds[p] for p in placements]),
             "norm": distribute_tensor(torch.ones(7), mesh, [Replicate()] * len(mesh_shape))}
    source = QuantizingSource(lambda: metas_from_dtensors(list(named.items()), rank),
                              lambda: {n: local_tensor(t) for n, t in named.items()},
                              {"w": (128, 128)}, rank, lambda t: all_reduce_max(t, world_size))
    source.refresh()
    tensors, out = source.tensors(), {}
    for meta in source.metas():
        pieces = []
        for p in meta.pieces_for_rank(rank):
            at = p.local_offset or (0,) * len(p.shape)
            region = tensors[meta.name][tuple(slice(o, o + n) for o, n in zip(at, p.shape, strict=True))]
            values = region.view(torch.uint8) if region.dtype == torch.float8_e4m3fn else region
            pieces.append({"offset": list(p.global_offset), "shape": list(p.shape),
                           "values": values.tolist()})
        out[meta.name] = {"shape": list(meta.global_shape), "dtype": meta.dtype, "pieces": pieces}
    return out


@pytest.mark.parametrize(("mesh_shape", "placements"), [
    ([3], ["rows"]),                 # FSDP2 over 3 ranks: row shards cut blocks 1 and 2
    ([2], ["cols"]),                 # TP column shards of 150: cut block column 1
    ([2, 2], ["rows", "cols"]),      # 2-D: rows over one mesh dim, columns over the other
    ([2, 2], ["replicate", "rows"]),  # replicas (HSDP-like): identical pieces on two ranks
])
def test_shards_quantized_where_they_live_equal_vllm_on_the_full_tensor(mesh_shape, placements):
    world = 1
    for s in mesh_shape:
        world *= s
    got = run_world(_quantize_world, world, mesh_shape, placements, timeout=300)
    want, want_scales = per_block_cast_to_fp8(_full(3), block_size=[128, 128], use_ue8m0=False)
    for name, reference in (("w", want.view(torch.uint8)), ("w_scale_inv", want_scales.float())):
        assembled = torch.full(reference.shape, -1, dtype=torch.float64)
        metas = []
        for rank, per_rank in enumerate(got):
            entry = per_rank[name]
            shards = []
            for p in entry["pieces"]:
                (r, c), (h, w) = p["offset"], p["shape"]
                assembled[r:r + h, c:c + w] = torch.tensor(p["values"], dtype=torch.float64)
                shards.append(ShardMeta(rank, tuple(p["offset"]), tuple(p["shape"])))
            metas.append([ParameterMeta(name, tuple(entry["shape"]), entry["dtype"], tuple(shards))])
        merge_metas(metas)  # raises on a gap or a partial overlap
        assert torch.equal(assembled, reference.double()), f"{name}: pieces differ from vLLM's quantizer"
    assert got[0]["w"]["dtype"] == "float8_e4m3fn" and got[0]["norm"]["dtype"] == "float32"
