"""The RL-loop awex update with no controller: ``RemoteInferenceEngine`` <-> ``FSDPTrainEngine``.

A 2-rank FSDPTrainEngine (dp=2, float32, a tiny Qwen2 from checkpoint A) runs in its own job
world (`_jobs.job_world`); a TP=2 server (`launch_server`) serves checkpoint B; a real
`KVStoreServer` holds the pair. Nobody forms the group: for each version the test does what an
RL loop does, ``fut = client.update_weights(meta)``, then (the trainer, on a signal file)
``engine.upload_weights(meta)``, then ``fut.result()``. On the first update both sides join by
the published-metadata rule (the client publishes ``infer_params_meta``, the trainer
``training_params_meta``, master port 0), the second (after one train step) only transfers.
After each, greedy generation equals transformers on the checkpoint the trainer saved of the
uploaded weights (near-tie rule), and every token carries the new version.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from _dist import run_world
from _inference_helpers import VOCAB, compare_greedy, http, load_hf, make_checkpoint
from _jobs import job_world, parent_store
from _losses import loss_tokens, next_token_loss

from awex_fast.net import KVStoreServer
from python_engines.api import WeightUpdateMeta
from python_engines.inference.remote import InferenceEngineConfig, RemoteInferenceEngine, WeightSyncJoinError
from python_engines.inference.server import launch_server

KEY = "awex-engine-flow-key"
PAIR = "awex-engine-flow"
PROMPT = [9, 18, 27, 36, 45]
VERSIONS = (1, 2)
TRAIN = 2


def _meta(kv_url: str, version: int) -> WeightUpdateMeta:
    # master port 0: inference transfer rank 0 binds one and publishes it in the KV store
    return WeightUpdateMeta.from_awex(PAIR, kv_url, master_port=0, admin_api_key=KEY, version=version)


def _trainer(rank: int, world_size: int, port: int, ckpt: str, kv_url: str, work: str) -> dict:
    import torch.distributed as dist
    from tensordict import TensorDict

    from python_engines.api import FinetuneSpec, SaveLoadMeta
    from python_engines.train import FSDPEngineConfig, FSDPTrainEngine, OptimizerConfig

    torch.set_num_threads(1)
    job_world(port, rank, [TRAIN], timeout=90.0)
    try:
        engine = FSDPTrainEngine(FSDPEngineConfig(path=ckpt, dtype="float32", device="cpu", optimizer=(
            OptimizerConfig(lr=3e-2, warmup_steps_proportion=0.0))))
        engine.initialize(None, FinetuneSpec(1, 8, 4))
        transfer_ranks, steps = [], []
        for v in VERSIONS:
            if v > 1:  # move the weights between the two updates
                g = torch.Generator().manual_seed(200 + rank)
                ids = torch.randint(0, VOCAB, (2, 16), generator=g)
                batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=[2])
                steps.append(engine.train_batch(batch, next_token_loss, loss_tokens)["update_successful"])
            engine.save(SaveLoadMeta(path=f"{work}/v{v}"))  # the reference for this version
            go = Path(f"{work}/go{v}")
            deadline = time.monotonic() + 90
            while not go.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"training rank {rank}: the test never asked for version {v}")
                time.sleep(0.02)
            engine.upload_weights(_meta(kv_url, v))
            transfer_ranks.append(engine.weight_sync_adapter().transfer_rank)
        dist.barrier()
        engine.destroy()
        return {"transfer_ranks": transfer_ranks, "steps": steps}
    finally:
        dist.destroy_process_group()


def _generate(url: str, prompt: list[int], n: int) -> dict:
    status, body = http("POST", f"{url}/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": n, "greedy": True}})
    assert status == 200, body
    return body["outputs"][0]


def _safe(fn):
    try:
        return fn()
    except BaseException as exc:  # re-raised in the test thread
        return exc


@pytest.mark.timeout(180)
def test_rl_loop_awex_updates_without_a_controller(tmp_path):
    t0 = time.perf_counter()
    ckpt_a = make_checkpoint(tmp_path / "A", seed=51)  # the trainer starts here
    ckpt_b = make_checkpoint(tmp_path / "B", seed=52)  # the server starts here
    work = tmp_path / "work"
    work.mkdir()
    store = parent_store(timeout=150.0)
    kv = KVStoreServer(admin_api_key=KEY).start()
    outcome: dict = {}
    world = threading.Thread(target=lambda: outcome.update(result=_safe(lambda: run_world(
        _trainer, TRAIN, store.port, ckpt_a, kv.url, str(work), backend=None, timeout=160))))
    world.start()
    server = None
    client = RemoteInferenceEngine(InferenceEngineConfig(admin_api_key=KEY, request_timeout=120))
    try:
        server = launch_server(ckpt_b, 2, max_seq_len=128, max_running=4, admin_api_key=KEY,
                               transfer_timeout_s=90.0, gang_timeout_s=60.0, setup_timeout=150)
        client.initialize(server.url)
        assert http("GET", f"{server.url}/health")[1]["weight_sync"] is None
        before = _generate(server.url, PROMPT, 12)["output_tokens"]

        # no KV store URL and no controller: refused before anything is published
        with pytest.raises(WeightSyncJoinError) as refused:
            client.update_weights(WeightUpdateMeta(type="awex", pair_name=PAIR, version=0)).result(60)
        assert refused.value.step == "kv_store_url"
        assert kv.store.keys(PAIR) == []

        outs = []
        for v in VERSIONS:
            fut = client.update_weights(_meta(kv.url, v))  # the receive half (joins on the first)
            (work / f"go{v}").write_text("1")  # the trainer's upload_weights (the send half)
            results = fut.result(150)
            assert len(results) == 2 and client.get_version() == v, results  # one answer per TP rank
            health = http("GET", f"{server.url}/health")[1]
            assert health["version"] == v and health["weights_valid"], health
            assert health["weight_sync"] == {"kind": "transfer", "pair_name": PAIR, "transfer_ranks": [0, 1],
                                             "failed": False}, health
            out = _generate(server.url, PROMPT, 12)
            assert out["output_versions"] == [v] * 12
            compare_greedy(load_hf(str(work / f"v{v}")), PROMPT, out["output_tokens"],
                           lambda p, n: _generate(server.url, p, n)["output_tokens"])
            outs.append(out["output_tokens"])
        assert outs[0] != before  # checkpoint A replaced B
        assert outs[1] != outs[0]  # the train step moved the weights, and version 2 landed them
        keys = set(kv.store.keys(PAIR))
        assert {"infer_params_meta", "training_params_meta", "transfer_master_port"} <= keys, keys
    finally:
        for v in VERSIONS:  # let a waiting trainer run into its upload (and fail) rather than hang
            (work / f"go{v}").write_text("1")
        world.join(170)
        client.destroy()
        if server is not None:
            server.shutdown()
        kv.stop()
    result = outcome.get("result")
    if isinstance(result, BaseException):
        raise result
    for rank, res in enumerate(result):
        assert res["steps"] == [1.0]
        assert res["transfer_ranks"] == [2 + rank] * 2  # after the 2 inference ranks; no re-join
    print(f"awex engine flow: {time.perf_counter() - t0:.1f} s wall")
