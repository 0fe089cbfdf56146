"""Train engine -> inference server, both ways the seed API offers, on real processes.

A 2-rank FSDPTrainEngine (dp=2, gloo, float32) trains from checkpoint A; a TP=2 server serves A.
Step 1, disk mode: the RL-loop order (``fut = engine.update_weights(meta)``, then the trainer's
``upload_weights(meta)``, then ``fut.result()``): the client waits for the trainer's version
marker, then every server rank loads its boxes. Step 2, awex mode: each training rank serves an
``awex_fast.TrainingAdapter`` over ``named_local_parameters()`` (FSDP2 DTensor shards) on
``/awex/*``, and a `WeightSyncPair` moves the FSDP dim-0 shards into the server's TP layout. After
each update, greedy generation equals transformers on the checkpoint the trainer saved of those
same weights (near-tie rule).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from _dist import run_world
from _inference_helpers import VOCAB, compare_greedy, http, load_hf, make_checkpoint
from _losses import loss_tokens, next_token_loss

from awex_fast.net import KVStoreServer
from awex_fast.sync import WeightSyncPair
from python_engines.api import WeightUpdateMeta
from python_engines.inference.remote import InferenceEngineConfig, RemoteInferenceEngine
from python_engines.inference.server import launch_server

KEY = "train-sync-test-key"
PROMPT = [11, 22, 33, 44]


def _trainer(rank: int, world_size: int, ckpt: str, work: str) -> dict:
    import os

    from tensordict import TensorDict

    from awex_fast.net import BackgroundServer
    from awex_fast.sync import TrainingAdapter, worker_app
    from python_engines.api import FinetuneSpec, SaveLoadMeta
    from python_engines.train import FSDPEngineConfig, FSDPTrainEngine, OptimizerConfig

    os.environ["AWEX_FAST_ADMIN_KEY"] = KEY
    torch.set_num_threads(1)
    optimizer = OptimizerConfig(lr=3e-2, warmup_steps_proportion=0.0)
    engine = FSDPTrainEngine(FSDPEngineConfig(path=ckpt, dtype="float32", device="cpu", optimizer=optimizer))
    engine.initialize(None, FinetuneSpec(1, 8, 4))
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=[2])
    losses = [engine.train_batch(batch, next_token_loss, loss_tokens)]
    engine.upload_weights(WeightUpdateMeta.from_disk(f"{work}/disk", version=1))
    losses.append(engine.train_batch(batch, next_token_loss, loss_tokens))
    engine.save(SaveLoadMeta(path=f"{work}/step2"))
    adapter = TrainingAdapter(engine.named_local_parameters, timeout_s=60.0)
    server = BackgroundServer(lambda: worker_app(adapter), "127.0.0.1", 0).start()
    url_file = Path(f"{work}/rank{rank}.url")
    url_file.with_suffix(".tmp").write_text(server.url)
    url_file.with_suffix(".tmp").replace(url_file)
    deadline = time.monotonic() + 150
    while not Path(f"{work}/done").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the test never finished the awex update")
        time.sleep(0.05)
    server.stop()
    engine.destroy()
    return {"losses": [float(s.get("loss", 0.0)) for s in losses]}


def _greedy(url: str, prompt: list[int], n: int) -> dict:
    status, body = http("POST", f"{url}/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": n, "greedy": True}})
    assert status == 200, body
    return body["outputs"][0]


@pytest.mark.timeout(300)
def test_train_engine_to_server_by_disk_and_by_awex(tmp_path):
    ckpt = make_checkpoint(tmp_path / "A", seed=41)
    work = tmp_path / "work"
    work.mkdir()
    server = launch_server(ckpt, 2, max_seq_len=128, max_running=4, admin_api_key=KEY, setup_timeout=180)
    kv = KVStoreServer(admin_api_key=KEY).start()
    engine = RemoteInferenceEngine(InferenceEngineConfig(admin_api_key=KEY, request_timeout=200))
    outcome: dict = {}
    world = threading.Thread(target=lambda: outcome.update(
        result=_safe(lambda: run_world(_trainer, 2, ckpt, str(work), timeout=260))))
    pair = None
    try:
        engine.initialize(server.url)
        before = _greedy(server.url, PROMPT, 12)["output_tokens"]
        disk = engine.update_weights(WeightUpdateMeta.from_disk(str(work / "disk"), version=1))
        world.start()
        assert disk.result(200)[0]["version"] == 1
        out = _greedy(server.url, PROMPT, 12)
        assert out["output_versions"] == [1] * 12
        compare_greedy(load_hf(str(work / "disk")), PROMPT, out["output_tokens"],
                       lambda p, n: _greedy(server.url, p, n)["output_tokens"])
        assert out["output_tokens"] != before  # training moved the weights enough to change them

        deadline = time.monotonic() + 200
        while not all((work / f"rank{r}.url").exists() for r in range(2)):
            assert world.is_alive() or "result" not in outcome, outcome
            assert time.monotonic() < deadline, "training ranks never served /awex"
            time.sleep(0.05)
        trainers = [(work / f"rank{r}.url").read_text() for r in range(2)]
        pair = WeightSyncPair("train-sync", kv.url, trainers, [[f"{server.url}/tp/0", f"{server.url}/tp/1"]],
                              admin_api_key=KEY, timeout_s=60.0)
        pair.connect()
        result = pair.update_weights(2)
        assert result["status"] == "ok", result
        out = _greedy(server.url, PROMPT, 12)
        assert out["output_versions"] == [2] * 12
        compare_greedy(load_hf(str(work / "step2")), PROMPT, out["output_tokens"],
                       lambda p, n: _greedy(server.url, p, n)["output_tokens"])
    finally:
        (work / "done").write_text("1")
        if world.is_alive() or world.ident is not None:
            world.join(280)
        if pair is not None:
            pair.close()
        engine.destroy()
        kv.stop()
        server.shutdown()
    result = outcome.get("result")
    if isinstance(result, BaseException):
        raise result
    assert json.loads(json.dumps(result))[0]["losses"]


def _safe(fn):
    try:
        return fn()
    except BaseException as exc:  # re-raised in the test thread
        return exc
