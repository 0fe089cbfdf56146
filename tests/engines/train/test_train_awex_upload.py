"""``FSDPTrainEngine.upload_weights("awex")`` without a controller, into two bare inference engines.

One spawned world holds three jobs, each with its own default gloo world (`_jobs.job_world`):
the training job (FSDPTrainEngine, dp=2, float32, a tiny random Qwen2), engine 0 (a bare
``awex_fast.InferenceAdapter`` per rank over a TP=2 vLLM fused layout in float32) and engine 1
(TP=1, float32). Nobody drives the pair: the engine publishes ``training_params_meta`` and joins
on its first awex upload (the rule in `python_engines.train.engine`); engine 0's rank 0 plays
the inference side's publisher (``infer_params_meta`` for both engines, sizes [2, 1]); every
inference rank reads the training world size from ``training_params_meta`` and joins.

Two uploads (version 1, then one train step, version 2). After each, the training job saves an
HF checkpoint (``engine.save``) and returns SHA-256s of every ``full_tensor()`` as JSON; the
inference ranks save their fused tensors. The parent checks that the checkpoint is what
``full_tensor()`` gathered, then builds every rank's fused tensors from the checkpoint with its
own vLLM-loader slicing (not `FusedLayout`) and requires ``torch.equal`` (bit-exact; for a
serving dtype other than float32, exactly torch's cast), vocabulary padding rows still zero.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch
from _dist import run_world
from _jobs import job_world, parent_store
from _losses import loss_tokens, next_token_loss
from safetensors.torch import load_file, save_file

from awex_fast.net import KVStoreServer

KEY = "train-awex-upload-key"
PAIR = "train-awex-upload"
CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,  # padded to 128 by the fused layout: padding rows on the last vocab shard
    "tie_word_embeddings": False,
}
TRAIN = 2
# (TP size, serving dtype) per engine. One dtype for all engines: the inference side's merged
# metadata has one dtype per parameter (awex_fast.meta.merge_metas refuses a mix).
ENGINES = [(2, "float32"), (1, "float32")]
JOBS = [TRAIN] + [tp for tp, _ in ENGINES]
SENTINEL = -7.0  # what the inference tensors hold before the first update lands
VERSIONS = (1, 2)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _trainer(rank: int, kv_url: str, work: str) -> dict:
    import torch.distributed as dist
    from tensordict import TensorDict
    from transformers import Qwen2Config

    from awex_fast.sync import AwexTrainingAdapter, TrainingAdapter
    from python_engines.api import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
    from python_engines.train import FSDPEngineConfig, FSDPTrainEngine, OptimizerConfig
    from python_engines.train.engine import WeightSyncNotWiredError

    cfg = {k: v for k, v in CONFIG.items() if k != "model_type"}
    engine = FSDPTrainEngine(FSDPEngineConfig(
        model_config=Qwen2Config(**cfg), dtype="float32", device="cpu", seed=7,
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps_proportion=0.0)))
    engine.initialize(None, FinetuneSpec(1, 8, 4))
    res: dict = {}
    adapter = engine.weight_sync_adapter()
    res["adapter"] = [isinstance(adapter, TrainingAdapter), isinstance(adapter, AwexTrainingAdapter),
                      engine.weight_sync_adapter() is adapter]
    try:  # no KV store URL and no controller: refused on every rank, before any publishing
        engine.upload_weights(WeightUpdateMeta(type="awex", pair_name=PAIR, admin_api_key=KEY, version=0))
        res["no_url"] = None
    except WeightSyncNotWiredError as exc:
        res["no_url"] = [exc.step, exc.failed_ranks]

    shas, stats, transfer_ranks = {}, [], []
    for v in VERSIONS:
        if v > 1:  # move the weights between the two uploads
            g = torch.Generator().manual_seed(100 + rank)
            ids = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=g)
            batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=[2])
            res["step"] = engine.train_batch(batch, next_token_loss, loss_tokens)["update_successful"]
        t0 = time.perf_counter()
        # "nccl" is AReaL's name for the in-memory path; master_port 0: inference rank 0 binds one.
        engine.upload_weights(WeightUpdateMeta(type="nccl", pair_name=PAIR, kv_store_url=kv_url,
                                               nccl_master_port=0, admin_api_key=KEY, version=v))
        stats.append({**engine.last_weight_update, "upload_s": time.perf_counter() - t0})
        transfer_ranks.append(adapter.transfer_rank)
        full = {n: t.full_tensor() for n, t in engine.named_local_parameters().items()}
        shas[v] = {n: _sha(t) for n, t in full.items()}
        engine.save(SaveLoadMeta(path=f"{work}/train_v{v}"))
    dist.barrier()
    engine.destroy()
    res.update(shas=shas, stats=stats, transfer_ranks=transfer_ranks)
    return res


def _inference(engine_id: int, rank: int, kv_url: str, work: str) -> dict:
    from awex_fast.layouts import FusedLayout
    from awex_fast.meta import merge_metas
    from awex_fast.net import KVStoreClient
    from awex_fast.sync import (
        INFER_META_KEY,
        MASTER_PORT_KEY,
        TRAINING_META_KEY,
        InferenceAdapter,
        decode_side_metas,
        encode_side_metas,
    )

    tp, dtype_name = ENGINES[engine_id]
    dtype = getattr(torch, dtype_name)
    layout = FusedLayout(CONFIG, tp, rank)
    fused = layout.allocate(dtype)  # padding rows zeroed, as vLLM leaves them
    views = layout.views(fused)
    for view in views.values():
        view.fill_(SENTINEL)
    adapter = InferenceAdapter(lambda: views, metas=layout.metas(dtype, rank), rank=rank, engine_size=tp,
                               admin_api_key=KEY, timeout_s=60.0)
    kv = KVStoreClient(kv_url, KEY)
    try:
        if engine_id == 0 and rank == 0:  # the inference side's publisher (knows every engine)
            kv.delete(PAIR, MASTER_PORT_KEY)
            groups = [merge_metas([FusedLayout(CONFIG, n, r).metas(d, r) for r in range(n)])
                      for n, d in ENGINES]
            kv.put(PAIR, INFER_META_KEY, encode_side_metas("inference", groups, [n for n, _ in ENGINES]))
        train_sizes, _ = decode_side_metas(kv.wait(PAIR, TRAINING_META_KEY, 60.0), "training")
    finally:
        kv.close()
    infer_world = sum(n for n, _ in ENGINES)
    train_world = sum(train_sizes)
    base = sum(n for n, _ in ENGINES[:engine_id])
    adapter.init_weight_update_group(
        pair_name=PAIR, master_addr="127.0.0.1", master_port=0, transfer_rank=base + rank,
        world_size=infer_world + train_world, kv_store_url=kv_url, infer_world_size=infer_world,
        train_world_size=train_world, num_engines=len(ENGINES))
    versions = []
    for v in VERSIONS:
        adapter.execute_weight_update(v)
        versions.append(adapter.version)
        out = f"{work}/infer_e{engine_id}_r{rank}_v{v}.safetensors"
        save_file({n: t.contiguous() for n, t in fused.items()}, out)
    adapter.teardown_weight_update_group()
    return {"versions": versions}


def _world(rank: int, world_size: int, port: int, kv_url: str, work: str) -> dict:
    import torch.distributed as dist

    job, local, _ = job_world(port, rank, JOBS, timeout=90.0)
    try:
        if job == 0:
            return _trainer(local, kv_url, work)
        return _inference(job - 1, local, kv_url, work)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------ independent construction


def _expected(sd: dict[str, torch.Tensor], tp: int, r: int) -> dict[str, torch.Tensor]:
    """TP rank ``r``'s fused tensors as vLLM's loader fills them (QKVParallelLinear,
    MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding / ParallelLMHead)."""
    hidden, heads, kv = CONFIG["hidden_size"], CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    hd, inter, vocab = hidden // heads, CONFIG["intermediate_size"], CONFIG["vocab_size"]
    q_rows, ir = heads // tp * hd, inter // tp
    kv_heads = max(1, kv // tp)
    kv0 = (r // (tp // kv) if tp >= kv else r * kv_heads) * hd
    per = -(-vocab // 64) * 64 // tp

    def vocab_shard(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(per, hidden, dtype=t.dtype)
        rows = t[r * per : (r + 1) * per]
        out[: rows.shape[0]] = rows
        return out

    out = {"model.embed_tokens.weight": vocab_shard(sd["model.embed_tokens.weight"]),
           "lm_head.weight": vocab_shard(sd["lm_head.weight"]), "model.norm.weight": sd["model.norm.weight"]}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a, m = f"{p}.self_attn", f"{p}.mlp"
        for kind in ("weight", "bias"):
            q, k, v = (sd[f"{a}.{x}_proj.{kind}"] for x in "qkv")
            q_part, kv_part = slice(r * q_rows, (r + 1) * q_rows), slice(kv0, kv0 + kv_heads * hd)
            out[f"{a}.qkv_proj.{kind}"] = torch.cat([q[q_part], k[kv_part], v[kv_part]])
        out[f"{a}.o_proj.weight"] = sd[f"{a}.o_proj.weight"][:, r * q_rows : (r + 1) * q_rows]
        rows = slice(r * ir, (r + 1) * ir)
        out[f"{m}.gate_up_proj.weight"] = torch.cat([sd[f"{m}.gate_proj.weight"][rows],
                                                     sd[f"{m}.up_proj.weight"][rows]])
        out[f"{m}.down_proj.weight"] = sd[f"{m}.down_proj.weight"][:, r * ir : (r + 1) * ir]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = sd[f"{p}.{norm}.weight"]
    return out


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


@pytest.mark.timeout(150)
def test_upload_weights_awex_without_controller(tmp_path):
    store = parent_store(timeout=120.0)
    t0 = time.perf_counter()
    with KVStoreServer("127.0.0.1", 0, admin_api_key=KEY) as kv:
        results = run_world(_world, sum(JOBS), store.port, kv.url, str(tmp_path), backend=None, timeout=130)
        keys = kv.store.keys(PAIR)
    elapsed = time.perf_counter() - t0
    trainers, inference = results[:TRAIN], results[TRAIN:]

    for res in trainers:
        assert res["adapter"] == [True, True, True]
        assert res["no_url"] == ["kv_store_url", [0, 1]]
        assert res["step"] == 1.0
        assert res["transfer_ranks"] == [3 + trainers.index(res)] * 2  # after 3 inference ranks; no re-join
        for s in res["stats"]:
            assert s["bytes_sent"] > 0, s
    assert trainers[0]["shas"] == trainers[1]["shas"]
    # rank 0 published the merged side and removed the per-rank staging keys
    assert "training_params_meta" in keys and not [k for k in keys if k.startswith("training_params_meta_")]
    for res in inference:
        assert res["versions"] == list(VERSIONS)

    fused_by_version = []
    for v in VERSIONS:
        sd = _checkpoint(tmp_path / f"train_v{v}")
        # engine.save wrote exactly what full_tensor() gathered at upload time.
        assert {n: _sha(t) for n, t in sd.items()} == trainers[0]["shas"][str(v)]
        got_all = {}
        for e, (tp, dtype_name) in enumerate(ENGINES):
            dtype = getattr(torch, dtype_name)
            for r in range(tp):
                got = load_file(str(tmp_path / f"infer_e{e}_r{r}_v{v}.safetensors"))
                want = {n: t.to(dtype) for n, t in _expected(sd, tp, r).items()}
                assert sorted(got) == sorted(want)
                for name, t in want.items():
                    assert got[name].dtype == dtype
                    assert torch.equal(got[name], t), (v, e, r, name)
                got_all[(e, r)] = got
        fused_by_version.append(got_all)
    # the train step moved the weights, and the second update landed them
    first, second = fused_by_version
    changed = [k for k in first if not torch.equal(first[k]["model.layers.0.self_attn.qkv_proj.weight"],
                                                   second[k]["model.layers.0.self_attn.qkv_proj.weight"])]
    assert len(changed) == len(first)
    print(f"awex upload test: {elapsed:.1f} s wall; upload stats rank 0: {trainers[0]['stats']}")
