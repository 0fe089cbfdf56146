"""Real FSDP2 and 2-D FSDP2 x TP DTensors on a transformers Qwen2 model synced through the
executor into TP inference engines, in separate job worlds joined only by the transfer group.

Oracle: every process builds the same tiny model from the same seed, so the inference processes
hold the full float32 weights independently of any sharding; after each sync their pieces must
equal those full weights sliced and cast to bfloat16, bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _dist import run_world
from _jobs import free_port, job_world, parent_store

from awex_fast.meta import (
    ParameterMeta,
    ShardRule,
    merge_metas,
    metas_from_json,
    metas_to_json,
    with_rank_offset,
)
from awex_fast.plan import build_plan
from awex_fast.transfer import Executor, wire_buckets
from awex_fast.transport import init_transfer_group

N_TRAIN = 4


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # 14 intermediate rows over dp2 x tp2 exercise the uneven _StridedShard case.
    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=14,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    return Qwen2ForCausalLM(cfg).float()


def shard_training_model(model, mode: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mode == "fsdp4":
        mesh = init_device_mesh("cpu", (N_TRAIN,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for layer in model.model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def tp_kind(name: str) -> int | None:
    if any(
        k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
    ):
        return 0
    if any(k in name for k in ("o_proj", "down_proj")) and name.endswith("weight"):
        return 1
    return None


def inference_metas(full: dict, tp: int, engines: int) -> list[ParameterMeta]:
    ranks = tuple(range(tp * engines))
    out = []
    for name, t in full.items():
        dim = tp_kind(name)
        if dim is None or tp == 1:
            rule = ShardRule(ranks, (), (), replicas=tp * engines)
        else:
            rule = ShardRule(ranks, (dim,), (tp,), replicas=engines)
        out.append(ParameterMeta(name, tuple(t.shape), "bfloat16", rules=(rule,)))
    return out


def _world(rank, world_size, port, group_ports, cases):
    from awex_fast.layouts import metas_from_dtensors

    n_infer = world_size - N_TRAIN
    job, local, _ = job_world(port, rank, [n_infer, N_TRAIN])
    is_train = job == 1
    model = tiny_model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    exchange = dist.PrefixStore("exchange/", dist.TCPStore("127.0.0.1", port, is_master=False))
    bad = []
    for case_index, (mode, tp, engines) in enumerate(cases):
        infer = inference_metas(full, tp, engines)
        if is_train:
            sharded = shard_training_model(tiny_model(), mode)
            locals_ = {n: p.to_local() for n, p in sharded.named_parameters()}
            mine = with_rank_offset(metas_from_dtensors(dict(sharded.named_parameters()), local), n_infer)
            # Training ranks exchange their metas as JSON through the store (no pickle).
            exchange.set(f"case{case_index}/rank{local}", metas_to_json(mine))
            parts = [metas_from_json(exchange.get(f"case{case_index}/rank{r}")) for r in range(N_TRAIN)]
            train = merge_metas(parts)
            exchange.set(f"case{case_index}/train", metas_to_json(train))
            tensors = locals_
        else:
            exchange.wait([f"case{case_index}/train"])
            train = metas_from_json(exchange.get(f"case{case_index}/train"))
            tensors = {}
            for m in infer:
                for p in m.pieces():
                    if p.rank == rank:
                        tensors[m.name] = torch.zeros(p.shape, dtype=torch.bfloat16)
        plan = build_plan(train, infer, bucket_bytes=8 << 10)
        group = init_transfer_group(
            "gloo", rank, world_size, "127.0.0.1", group_ports[case_index], timeout=60
        )
        ex = Executor(wire_buckets(plan.for_rank(rank)), tensors, group, digest=plan.digest())
        ex.handshake()
        for version in range(2):
            if version == 1 and is_train:
                with torch.no_grad():
                    for t in tensors.values():
                        t.neg_()  # new weights, same storage; the oracle negates too
            ex.run(version)
            if not is_train:
                sign = -1.0 if version == 1 else 1.0
                for m in infer:
                    for p in m.pieces():
                        if p.rank == rank:
                            box = tuple(
                                slice(o, o + s) for o, s in zip(p.global_offset, p.shape, strict=True)
                            )
                            want = (full[m.name][box] * sign).to(torch.bfloat16)
                            if not torch.equal(tensors[m.name], want):
                                bad.append(f"{mode}->tp{tp}x{engines} v{version} {m.name}")
        group.close()
    return {"bad": bad}


def test_fsdp2_dp4_to_two_tp2_engines_and_2d_to_tp4():
    store = parent_store()
    cases = [("fsdp4", 2, 2), ("2d", 4, 1)]
    out = run_world(
        _world, N_TRAIN + 4, store.port, [free_port(), free_port()], cases, backend=None, timeout=280
    )
    assert all(o["bad"] == [] for o in out), [o["bad"] for o in out]
