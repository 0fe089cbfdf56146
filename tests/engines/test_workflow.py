"""WorkflowExecutor staleness control and RLVRWorkflow, over a real TP=1 server (random weights).

The staleness bound (python_engines/workflow.py): with consumer batch size ``bs`` and
``max_head_offpolicyness`` ``k``, at most ``(k + version + 1) * bs`` episodes may ever start by
weight ``version``; rejected trajectories give their budget back.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from _inference_helpers import hf_config
from tensordict import TensorDict
from torchdata.stateful_dataloader import StatefulDataLoader

from python_engines.api import GenerationHyperparameters, InferenceEngine, RolloutWorkflow
from python_engines.inference.remote import InferenceEngineConfig, RemoteInferenceEngine
from python_engines.inference.server import launch_server
from python_engines.workflow import RLVRWorkflow

pytestmark = pytest.mark.timeout(180)

SHORT = GenerationHyperparameters(max_new_tokens=2, greedy=True)


@pytest.fixture(scope="module")
def server():
    handle = launch_server(hf_config(), 1, max_seq_len=256, max_running=32, seed=5, setup_timeout=180)
    yield handle
    handle.shutdown()


@pytest.fixture
def make_engine(server):
    engines = []

    def make(**config) -> RemoteInferenceEngine:
        engine = RemoteInferenceEngine(InferenceEngineConfig(admin_api_key=server.admin_api_key, **config))
        engine.initialize(server.url)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.destroy()


def length_reward(prompt, completion, prompt_ids, completion_ids, **data) -> float:
    return float(len(completion_ids))


def items(n: int) -> list[dict]:
    return [{"input_ids": [i % 100 + 1, 2, 3], "idx": i} for i in range(n)]


def test_config_defaults():
    cfg = InferenceEngineConfig()
    assert (cfg.consumer_batch_size, cfg.max_concurrent_rollouts, cfg.queue_size) == (1, 1, 16)
    assert (cfg.max_head_offpolicyness, cfg.setup_timeout, cfg.request_timeout, cfg.request_retries) == (
        0, 120.0, 3600.0, 3)
    cfg = InferenceEngineConfig(consumer_batch_size=4)
    assert cfg.max_concurrent_rollouts == 4 and cfg.queue_size == 64
    with pytest.raises(ValueError, match="consumer_batch_size"):
        InferenceEngineConfig(consumer_batch_size=0)


@pytest.mark.parametrize(("bs", "k"), [(2, 0), (3, 1)])
def test_staleness_bound_and_version_growth(make_engine, bs, k):
    engine = make_engine(consumer_batch_size=bs, max_head_offpolicyness=k, max_concurrent_rollouts=64)
    try:
        workflow = RLVRWorkflow(length_reward, SHORT)
        for item in items(20):
            engine.submit(item, workflow)
        bound = bs * (k + 1)
        batch = engine.wait(bound, timeout=60)
        assert batch.batch_size[0] == bound
        with pytest.raises(TimeoutError, match="0 of 1 trajectories"):
            engine.wait(1, timeout=1.0)
        stat = engine.executor.stat
        assert (stat.submitted, stat.accepted, stat.running) == (bound, bound, 0)
        engine.set_version(1)
        assert engine.wait(bs, timeout=60).batch_size[0] == bs  # the bound grew by bs
        with pytest.raises(TimeoutError):
            engine.wait(1, timeout=1.0)
        assert engine.executor.stat.accepted == bound + bs
    finally:
        engine.set_version(0)


def test_fewer_submitted_than_the_bound_all_run(make_engine):
    engine = make_engine(consumer_batch_size=4, max_head_offpolicyness=2, max_concurrent_rollouts=64)
    for item in items(3):
        engine.submit(item, RLVRWorkflow(length_reward, SHORT))
    assert engine.wait(3, timeout=60).batch_size[0] == 3
    time.sleep(0.2)
    assert engine.executor.stat.accepted == 3


def test_rejected_trajectories_free_their_budget(make_engine):
    engine = make_engine(consumer_batch_size=2, max_concurrent_rollouts=64)
    for item in items(8):
        engine.submit(item, RLVRWorkflow(length_reward, SHORT))
    seen = []

    def accept_even(traj: TensorDict) -> bool:
        seen.append(int(traj["input_ids"][0, 0]))
        return int(traj["input_ids"][0, 0]) % 2 == 1  # prompts of even idx start with an odd token

    batch = engine.wait(2, timeout=60, should_accept=accept_even)
    assert batch.batch_size[0] == 2 and all(int(t) % 2 == 1 for t in batch["input_ids"][:, 0])
    stat = engine.executor.stat
    assert stat.rejected == len(seen) - 2 and stat.accepted == 2
    assert stat.submitted == 2 + stat.rejected  # each rejection let one more episode start


def test_per_client_share(make_engine):
    engine = make_engine(consumer_batch_size=4, max_concurrent_rollouts=8, num_clients=2)
    assert (engine.executor.batch_share, engine.executor.max_concurrent) == (2, 4)
    for item in items(6):
        engine.submit(item, RLVRWorkflow(length_reward, SHORT))
    engine.wait(2, timeout=60)
    with pytest.raises(TimeoutError):
        engine.wait(1, timeout=1.0)


class _CountingWorkflow(RolloutWorkflow):
    """RLVR episodes that record how many of them run at once."""

    def __init__(self, gconfig: GenerationHyperparameters) -> None:
        self.inner = RLVRWorkflow(length_reward, gconfig)
        self.now = self.peak = 0

    async def arun_episode(self, engine: InferenceEngine, data: dict) -> TensorDict:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            return await self.inner.arun_episode(engine, data)
        finally:
            self.now -= 1


def test_max_concurrent_rollouts_and_pause(make_engine):
    engine = make_engine(consumer_batch_size=16, max_concurrent_rollouts=3)
    workflow = _CountingWorkflow(GenerationHyperparameters(max_new_tokens=24, greedy=True))
    engine.executor.pause()
    for item in items(9):
        engine.submit(item, workflow)
    time.sleep(0.5)
    assert engine.executor.stat.submitted == 0  # paused: nothing starts
    engine.executor.resume()
    assert engine.wait(9, timeout=60).batch_size[0] == 9
    assert workflow.peak == 3


def test_rlvr_trajectory_layout(make_engine):
    engine = make_engine(consumer_batch_size=1)
    gconfig = GenerationHyperparameters(n_samples=3, max_new_tokens=6, temperature=1.0)
    calls = []

    def reward(prompt, completion, prompt_ids, completion_ids, **data):
        calls.append((prompt, completion, prompt_ids, completion_ids, data))
        return float(completion_ids[0] % 2)

    traj = engine.rollout_batch([{"input_ids": [4, 5], "answer": "x"}], RLVRWorkflow(reward, gconfig))
    assert traj.batch_size[0] == 3 and traj["input_ids"].shape == (3, 8)
    assert torch.equal(traj["loss_mask"][:, :2], torch.zeros(3, 2, dtype=torch.long))
    assert torch.equal(traj["loss_mask"][:, 2:], torch.ones(3, 6, dtype=torch.long))
    assert torch.equal(traj["versions"], torch.tensor([[-1, -1] + [0] * 6] * 3))
    assert (traj["logprobs"][:, 2:] < 0).all() and (traj["logprobs"][:, :2] == 0).all()
    assert [c[4] for c in calls] == [{"answer": "x"}] * 3 and calls[0][2] == [4, 5] and calls[0][0] is None
    assert torch.equal(traj["rewards"], torch.tensor([float(c[3][0] % 2) for c in calls]))
    assert torch.equal(traj["input_ids"][:, 2:], torch.tensor([c[3] for c in calls]))


def test_prepare_batch_from_a_dataloader(make_engine):
    engine = make_engine(consumer_batch_size=4, max_head_offpolicyness=1)
    loader = StatefulDataLoader(items(10), batch_size=4, collate_fn=lambda x: x)
    workflow = RLVRWorkflow(length_reward, SHORT)
    first = engine.prepare_batch(loader, workflow)
    second = engine.prepare_batch(loader, workflow)
    assert first.batch_size[0] == second.batch_size[0] == 4
    assert engine.executor.stat.submitted <= 8  # (k + 0 + 1) * bs at version 0


def test_a_failing_episode_is_reported_by_wait(make_engine):
    engine = make_engine()

    def broken_reward(*args, **kwargs):
        raise ZeroDivisionError("reward model is down")

    engine.submit(items(1)[0], RLVRWorkflow(broken_reward, SHORT))
    with pytest.raises(RuntimeError, match="rollout episode failed") as info:
        engine.wait(1, timeout=30)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_agenerate_resumes_after_pause_with_its_output_so_far(make_engine, server):
    engine = make_engine()
    from python_engines.api import LLMRequest

    gconfig = GenerationHyperparameters(max_new_tokens=160, greedy=True)
    reference = asyncio.run(engine.agenerate(LLMRequest(input_ids=[8, 8], gconfig=gconfig)))

    async def interrupted():
        task = asyncio.create_task(engine.agenerate(LLMRequest(input_ids=[8, 8], gconfig=gconfig)))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(engine.pause)  # interrupts on the server, stops new episodes
        await asyncio.sleep(0.3)
        assert not task.done()
        await asyncio.to_thread(engine.resume)
        return await task

    resp = asyncio.run(interrupted())
    assert resp.stop_reason == "length" and resp.output_tokens == reference.output_tokens
    assert len(resp.output_logprobs) == len(resp.output_versions) == 160
    assert resp.ttft < resp.latency and len(resp.itl) == 159
