"""The seed engine API structs: AReaL field names and defaults, arithmetic, aliases, markers."""

import asyncio
import dataclasses
import json
import math
import threading
import time
import uuid

import pytest
import torch

from python_engines.api import (
    WEIGHT_VERSION_MARKER,
    FinetuneSpec,
    GenerationHyperparameters,
    InferenceEngine,
    LLMRequest,
    LLMResponse,
    ParamSpec,
    RolloutWorkflow,
    SaveLoadMeta,
    Scheduling,
    TrainEngine,
    WeightUpdateMeta,
    read_weight_version,
    wait_for_weight_version,
    write_weight_version,
)


def _fields(cls):
    return [(f.name, f.default) for f in dataclasses.fields(cls)]


def test_scheduling_defaults():
    s = Scheduling(cpu=4, gpu=1, mem=32 * 1024)
    assert (s.nodelist, s.exclude, s.partition, s.container_image) == (None, None, None, None)
    assert (s.time_limit, s.begin, s.deadline) == (None, None, None)
    assert s.env_vars == {}
    s.env_vars["A"] = "1"
    assert Scheduling(cpu=1, gpu=0, mem=1).env_vars == {}  # no shared mutable default


@pytest.mark.parametrize(
    ("epochs", "size", "batch", "per_epoch", "total"),
    [(3, 100, 8, 12, 36), (1, 8, 8, 1, 1), (2, 7, 8, 0, 0), (0, 100, 10, 10, 0)],
)
def test_finetune_spec_steps(epochs, size, batch, per_epoch, total):
    spec = FinetuneSpec(total_train_epochs=epochs, dataset_size=size, train_batch_size=batch)
    assert spec.steps_per_epoch == per_epoch
    assert spec.total_train_steps == total


def test_finetune_spec_rejects_zero_batch():
    with pytest.raises(ValueError, match="train_batch_size"):
        FinetuneSpec(1, 10, 0)


def test_param_spec():
    spec = ParamSpec("model.norm.weight", [32], "bfloat16")
    assert spec.shape == (32,) and spec.numel == 32
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        ParamSpec("model.norm.weight", (32,), "torch.bfloat16")


def test_save_load_meta_defaults():
    assert _fields(SaveLoadMeta)[1:] == [
        ("weight_format", "hf"),
        ("with_optim", False),
        ("tokenizer", None),
        ("base_model_path", None),
        ("naive_distributed", False),
    ]


def test_weight_update_meta_defaults_and_alias():
    meta = WeightUpdateMeta(type="nccl")
    assert meta.type == "awex"
    assert meta.path is None
    assert (meta.nccl_master_address, meta.nccl_master_port) == ("127.0.0.1", 29500)
    assert (meta.master_address, meta.master_port) == ("127.0.0.1", 29500)
    assert meta.nccl_param_specs == [] and meta.nccl_group_name == "update_weight_group"
    awex_fields = (meta.pair_name, meta.kv_store_url, meta.admin_api_key, meta.version)
    assert awex_fields == ("default", None, None, None)
    meta.nccl_param_specs.append(ParamSpec("x", (1,), "float32"))
    assert WeightUpdateMeta(type="awex").nccl_param_specs == []
    with pytest.raises(ValueError, match="type"):
        WeightUpdateMeta(type="tcp")
    with pytest.raises(ValueError, match="path"):
        WeightUpdateMeta(type="disk")
    with pytest.raises(ValueError, match="pair_name"):
        WeightUpdateMeta(type="awex", pair_name="a/b")


def test_weight_update_meta_constructors(monkeypatch):
    disk = WeightUpdateMeta.from_disk("/tmp/w", version=3)
    assert (disk.type, disk.path, disk.version) == ("disk", "/tmp/w", 3)
    monkeypatch.setenv("AWEX_FAST_ADMIN_KEY", "secret")
    awex = WeightUpdateMeta.from_awex("pair0", "http://127.0.0.1:1234", master_port=4321, version=7)
    assert (awex.type, awex.pair_name, awex.kv_store_url) == ("awex", "pair0", "http://127.0.0.1:1234")
    assert (awex.master_port, awex.admin_api_key, awex.version) == (4321, "secret", 7)
    explicit = WeightUpdateMeta.from_awex("p", "http://h:1", admin_api_key="k")
    assert explicit.admin_api_key == "k"


def test_generation_hyperparameters_defaults_and_new():
    g = GenerationHyperparameters()
    assert _fields(GenerationHyperparameters)[:7] == [
        ("n_samples", 1),
        ("max_new_tokens", 16384),
        ("min_new_tokens", 0),
        ("greedy", False),
        ("top_p", 1.0),
        ("top_k", 100_000_000),
        ("temperature", 1.0),
    ]
    assert g.stop_token_ids == []
    g.stop_token_ids.append(2)
    h = g.new(temperature=0.5, n_samples=4)
    assert (h.temperature, h.n_samples, h.stop_token_ids) == (0.5, 4, [2])
    h.stop_token_ids.append(3)
    assert g.stop_token_ids == [2]  # .new() copies lists
    assert g.temperature == 1.0
    with pytest.raises(TypeError, match="temprature"):
        g.new(temprature=0.1)
    with pytest.raises(ValueError, match="top_p"):
        g.new(top_p=0.0)


def test_llm_request_and_response():
    a, b = LLMRequest(), LLMRequest(input_ids=[1, 2])
    assert a.rid != b.rid and uuid.UUID(a.rid).version == 4
    assert a.input_ids == [] and a.metadata == {} and a.model_id is None
    assert a.gconfig == GenerationHyperparameters() and a.gconfig is not b.gconfig
    r = LLMResponse(input_tokens=[1, 2, 3], output_tokens=[4, 5])
    assert (r.input_len, r.output_len) == (3, 2)
    assert r.stop_reason == "stop" and math.isinf(r.latency) and math.isinf(r.ttft) and r.itl == []
    assert LLMResponse().output_logprobs == [] and LLMResponse().output_versions == []


def test_engines_are_abstract():
    with pytest.raises(TypeError):
        TrainEngine()
    with pytest.raises(TypeError):
        InferenceEngine()
    with pytest.raises(TypeError):
        RolloutWorkflow()


def test_rollout_workflow_can_reject():
    from tensordict import TensorDict

    class Keep(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            if data["score"] < 0:
                return None
            return TensorDict({"score": torch.tensor([data["score"]])}, batch_size=[1])

    assert asyncio.run(Keep().arun_episode(None, {"score": -1})) is None
    assert asyncio.run(Keep().arun_episode(None, {"score": 2}))["score"].item() == 2


def test_weight_version_marker(tmp_path):
    assert read_weight_version(tmp_path) is None
    marker = write_weight_version(tmp_path, 4)
    assert marker.name == WEIGHT_VERSION_MARKER
    assert json.loads(marker.read_text())["version"] == 4
    assert read_weight_version(tmp_path) == 4
    assert [p.name for p in tmp_path.iterdir()] == [WEIGHT_VERSION_MARKER]  # no temp file left
    with pytest.raises(TimeoutError, match="version >= 5"):
        wait_for_weight_version(tmp_path, 5, timeout=0.1)
    writer = threading.Timer(0.1, write_weight_version, args=(tmp_path, 6))
    writer.start()
    start = time.monotonic()
    assert wait_for_weight_version(tmp_path, 5, timeout=10) == 6
    assert time.monotonic() - start < 5
    writer.join()
    marker.write_text("{}")
    with pytest.raises(ValueError, match="malformed"):
        read_weight_version(tmp_path)
