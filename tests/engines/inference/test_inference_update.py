"""Weight updates into a running TP=2 server: in the middle of a generation, from disk, through
awex_fast (`WeightSyncPair` and the client engine's ``update_weights``), and failures that must
leave the server refusing generation until a good update lands.

One server for the module (tests run in file order and each sets the weights it checks).
The training side of awex updates is `_inference_trainer.py`, a real process serving the
``/awex/*`` routes, so the test can kill it mid-pair.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _inference_helpers import compare_greedy, hf_greedy, http, load_hf, make_checkpoint
from safetensors.torch import load_file, save_file

from awex_fast.net import KVStoreServer
from awex_fast.sync import WeightSyncPair
from python_engines.api import WeightUpdateMeta
from python_engines.inference.remote import GenerationRefused, InferenceEngineConfig, RemoteInferenceEngine
from python_engines.inference.server import launch_server

pytestmark = pytest.mark.timeout(240)

PROMPT = [7, 3, 99, 42, 5]
KEY = "inference-update-test-key"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return {name: make_checkpoint(root / name, seed=seed) for name, seed in
            (("A", 31), ("B", 32), ("C", 33), ("D", 34))}


@pytest.fixture(scope="module")
def server(ckpts):
    handle = launch_server(ckpts["A"], 2, max_seq_len=512, max_running=8, admin_api_key=KEY,
                           transfer_timeout_s=45.0, gang_timeout_s=45.0, setup_timeout=180)
    yield handle
    handle.shutdown()


def generate(url: str, prompt: list[int], n: int) -> dict:
    status, body = http("POST", f"{url}/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": n, "greedy": True}})
    assert status == 200, body
    return body["outputs"][0]


def greedy(url: str, prompt: list[int], n: int) -> list[int]:
    return generate(url, prompt, n)["output_tokens"]


def assert_serves(url: str, ckpt: str, version: int, n: int = 16) -> None:
    out = generate(url, PROMPT, n)
    assert out["output_versions"] == [version] * n
    compare_greedy(load_hf(ckpt), PROMPT, out["output_tokens"], lambda p, k: greedy(url, p, k))


def disk_update(url: str, path: str, version: int | None) -> tuple[int, dict]:
    return http("POST", f"{url}/update_weights_from_disk", {"model_path": path, "version": version}, key=KEY)


def test_update_in_the_middle_of_a_long_generation(server, ckpts):
    url = server.url
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, url, PROMPT, 400)
        deadline = time.monotonic() + 30
        while http("GET", f"{url}/metrics")[1]["running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.05)
        status, body = disk_update(url, ckpts["B"], 1)
        assert status == 200 and body["version"] == 1, body
        out = running.result(60)
    versions = out["output_versions"]
    k = versions.count(0)
    assert 0 < k < 400 and versions == [0] * k + [1] * (400 - k), versions
    tokens = out["output_tokens"]
    assert tokens[:k] == hf_greedy(load_hf(ckpts["A"]), PROMPT, k)
    # After the update: what B generates greedily from the prefix (KV recomputed with B).
    compare_greedy(load_hf(ckpts["B"]), PROMPT + tokens[:k], tokens[k:], lambda p, n: greedy(url, p, n))
    metrics = http("GET", f"{url}/metrics")[1]
    assert metrics["version"] == 1 and metrics["last_update"]["pause_to_resume_ms"] > 0


def test_failed_disk_update_refuses_generation_until_a_good_update(server, ckpts, tmp_path):
    url = server.url
    broken = tmp_path / "broken"
    shutil.copytree(ckpts["B"], broken)
    state = load_file(broken / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    status, body = disk_update(url, str(broken), 2)
    assert status == 500 and "model.layers.1.mlp.down_proj.weight" in body["error"], body
    status, body = http("POST", f"{url}/generate", {"input_ids": PROMPT})
    assert status == 503 and body["code"] == "weights_invalid" and "failed" in body["error"], body
    assert http("GET", f"{url}/health")[1]["weights_valid"] is False
    engine = RemoteInferenceEngine(InferenceEngineConfig(admin_api_key=KEY, request_retries=0))
    engine.initialize(url)
    try:
        import asyncio

        from python_engines.api import GenerationHyperparameters, LLMRequest

        req = LLMRequest(input_ids=PROMPT, gconfig=GenerationHyperparameters(max_new_tokens=4, greedy=True))
        with pytest.raises(GenerationRefused, match="weight update from disk"):
            asyncio.run(engine.agenerate(req))
        # a good update through the client engine (disk mode waits for the trainer's marker)
        from python_engines.api import write_weight_version

        write_weight_version(ckpts["A"], 3)
        results = engine.update_weights(WeightUpdateMeta.from_disk(ckpts["A"], version=3)).result(60)
        assert results[0]["version"] == 3 and engine.get_version() == 3
        assert_serves(url, ckpts["A"], 3)
    finally:
        engine.destroy()


def _start_trainer(ckpt: str, url_file: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "AWEX_FAST_ADMIN_KEY": KEY, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    trainer = Path(__file__).resolve().parents[2] / "_inference_trainer.py"
    proc = subprocess.Popen([sys.executable, str(trainer), ckpt, str(url_file)], env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not url_file.exists():
        assert proc.poll() is None, "trainer process exited during startup"
        assert time.monotonic() < deadline, "trainer process did not start"
        time.sleep(0.05)
    return proc, url_file.read_text()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_awex_updates_and_a_killed_sender(server, ckpts, tmp_path):
    url = server.url
    kv = KVStoreServer(admin_api_key=KEY).start()
    procs = []
    pair = None
    engine = RemoteInferenceEngine(InferenceEngineConfig(admin_api_key=KEY))
    try:
        proc, trainer = _start_trainer(ckpts["C"], tmp_path / "trainer1")
        procs.append(proc)
        pair = WeightSyncPair("infer-test", kv.url, [trainer], [[f"{url}/tp/0", f"{url}/tp/1"]],
                              admin_api_key=KEY, timeout_s=60.0)
        pair.connect()
        result = pair.update_weights(5)
        assert result["status"] == "ok", result
        assert_serves(url, ckpts["C"], 5)

        # The RL-loop order: the engine starts the receive half, the trainer sends, then wait.
        engine.initialize(url)
        fut = engine.update_weights(WeightUpdateMeta.from_awex("infer-test", kv.url, admin_api_key=KEY,
                                                               version=6))
        status, body = http("POST", f"{trainer}/awex/update_weights", {"version": 6}, key=KEY)
        assert status == 200, body
        assert len(fut.result(60)) == 2 and engine.get_version() == 6  # one answer per TP rank
        assert_serves(url, ckpts["C"], 6, n=8)

        _kill(proc)
        result = pair.update_weights(7)
        assert result["status"] == "failed" and result["error"], result
        status, body = http("POST", f"{url}/generate", {"input_ids": PROMPT})
        assert status == 503 and "awex weight update to version 7 failed" in body["error"], body

        proc, trainer = _start_trainer(ckpts["D"], tmp_path / "trainer2")
        procs.append(proc)
        pair.replace_worker("training", 0, trainer)
        result = pair.update_weights(8)
        assert result["status"] == "ok" and result["reformed"], result
        assert_serves(url, ckpts["D"], 8)
    finally:
        engine.destroy()
        if pair is not None:
            pair.close()
        for p in procs:
            _kill(p)
        kv.stop()
