"""The inference server over real HTTP: greedy parity with transformers at TP=1, TP=2 and with
replicated KV heads, logprobs, continuous batching with a KV cache, sampling options, auth,
pause/continue.

Three servers (started concurrently, shared by the module, since starting a rank costs seconds
on a small CI machine): TP=1 and TP=2 on the default tiny Qwen2 (4 heads, 2 KV heads), and TP=2
on a 1-KV-head variant (both ranks read KV head 0). Greedy comparisons use the near-tie rule of
`_inference_helpers.compare_greedy`. Logprob tolerance: our log_softmax is over logits that
match transformers' to ~3e-6 (see test_inference_model.py); 1e-4 absolute keeps a 30x margin.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch
from _inference_helpers import VOCAB, compare_greedy, hf_logits, http, load_hf, make_checkpoint

from python_engines.inference.server import launch_server

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 17, 99, 3], [1], [64, 2, 8, 8, 31, 120, 7, 0, 45, 12, 9]]
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"kv2": make_checkpoint(root / "kv2", seed=21),
            "kv1": make_checkpoint(root / "kv1", seed=22, num_key_value_heads=1)}


@pytest.fixture(scope="module")
def servers(checkpoints):
    specs = {"tp1": (checkpoints["kv2"], 1), "tp2": (checkpoints["kv2"], 2),
             "tp2-kv1": (checkpoints["kv1"], 2)}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futs = {name: pool.submit(launch_server, path, tp, max_seq_len=192, max_running=16,
                                  setup_timeout=180) for name, (path, tp) in specs.items()}
        handles = {}
        try:
            for name, fut in futs.items():
                handles[name] = fut.result()
        except BaseException:
            for h in handles.values():
                h.shutdown()
            raise
    yield {name: (handles[name], specs[name][0]) for name in specs}
    for h in handles.values():
        h.shutdown()


def generate(url: str, prompt: list[int], n: int, **sampling) -> dict:
    status, body = http("POST", f"{url}/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": n, "greedy": True, **sampling}})
    assert status == 200, body
    return body


def greedy(url: str, prompt: list[int], n: int) -> list[int]:
    return generate(url, prompt, n)["outputs"][0]["output_tokens"]


@pytest.mark.parametrize("name", ["tp1", "tp2", "tp2-kv1"])
def test_greedy_and_logprobs_match_transformers(servers, name):
    handle, path = servers[name]
    ref_model = load_hf(path)
    for prompt in PROMPTS:
        out = generate(handle.url, prompt, 24)["outputs"][0]
        assert out["stop_reason"] == "length" and out["output_versions"] == [0] * 24
        compare_greedy(ref_model, prompt, out["output_tokens"], lambda p, n: greedy(handle.url, p, n))
        # logprobs of our own tokens under transformers' teacher-forced log-softmax
        seq = prompt + out["output_tokens"]
        logp = torch.log_softmax(hf_logits(ref_model, seq), -1)
        expect = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out["output_tokens"])]
        torch.testing.assert_close(torch.tensor(out["output_logprobs"]), torch.tensor(expect),
                                   atol=LOGPROB_ATOL, rtol=0)


def _metrics(url: str) -> dict:
    status, body = http("GET", f"{url}/metrics")
    assert status == 200
    return body


def test_concurrent_requests_are_batched_and_use_the_kv_cache(servers):
    handle, path = servers["tp1"]
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 12, (8,), generator=g).tolist()
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    n_new = 100
    alone = [greedy(handle.url, p, n_new) for p in prompts]
    before = _metrics(handle.url)
    barrier = threading.Barrier(8)

    def one(p: list[int]) -> list[int]:
        barrier.wait()
        return greedy(handle.url, p, n_new)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, prompts))
    after = _metrics(handle.url)
    ref_model = load_hf(path)
    for p, a, t in zip(prompts, alone, together, strict=True):
        if a != t:  # batching changes float32 rounding; only a near tie may flip a token
            compare_greedy(ref_model, p, t, lambda q, n: greedy(handle.url, q, n))
    hist = {int(k): v - before["decode_batch_hist"].get(k, 0) for k, v in after["decode_batch_hist"].items()}
    assert max(k for k, v in hist.items() if v > 0) >= 4, hist  # >= 4 requests shared a decode step
    # A KV cache feeds each token through the model once: the prompt, then one token per decode
    # step per request (the last sampled token is never fed). Recomputing prefixes would feed more.
    fed = after["forward_tokens"] - before["forward_tokens"]
    assert fed == sum(len(p) for p in prompts) + 8 * (n_new - 1)
    decode_rows = sum(k * v for k, v in hist.items())
    assert after["decode_tokens"] - before["decode_tokens"] == decode_rows  # one token per running request
    assert after["generated_tokens"] - before["generated_tokens"] == 8 * n_new


def test_sampling_options_over_http(servers):
    url = servers["tp2"][0].url
    body = generate(url, [3, 4, 5], 12, greedy=False, temperature=0.8, top_p=0.9, top_k=20, n_samples=3)
    assert len(body["outputs"]) == 3 and body["input_tokens"] == [3, 4, 5]
    for out in body["outputs"]:
        assert len(out["output_tokens"]) == 12 and all(lp <= 0 for lp in out["output_logprobs"])
        assert len(out["itl"]) == 11 and out["ttft"] >= 0 and out["latency"] >= out["ttft"]
    first = greedy(url, [3, 4, 5], 8)
    stop = first[2]
    out = generate(url, [3, 4, 5], 8, stop_token_ids=[stop])["outputs"][0]
    cut = first.index(stop) + 1
    assert out["stop_reason"] == "stop" and out["output_tokens"] == first[:cut]
    out = generate(url, [3, 4, 5], 8, stop_token_ids=[stop], min_new_tokens=8)["outputs"][0]
    assert out["stop_reason"] == "length" and stop not in out["output_tokens"]
    assert http("POST", f"{url}/generate", {"input_ids": [VOCAB]})[0] == 400
    too_long = {"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 100}}
    status, err = http("POST", f"{url}/generate", too_long)
    assert status == 400 and "max_seq_len 192" in err["error"]
    status, err = http("POST", f"{url}/generate", {"input_ids": [1], "sampling_params": {"top_q": 1}})
    assert status == 400 and "top_q" in err["error"]


def test_mutating_routes_need_the_key(servers):
    handle = servers["tp2"][0]
    for route in ("/pause_generation", "/continue_generation", "/set_version", "/update_weights_from_disk",
                  "/awex/update_weights", "/tp/1/awex/teardown"):
        assert http("POST", f"{handle.url}{route}", {})[0] == 401, route
        assert http("POST", f"{handle.url}{route}", {}, key="wrong")[0] == 403, route
    status, body = http("GET", f"{handle.url}/tp/1/awex/report_parallelism")
    assert status == 200 and body["result"]["rank"] == 1 and body["result"]["world_size"] == 2
    assert http("GET", f"{handle.url}/health")[1]["tp_size"] == 2


def test_pause_interrupts_and_holds_requests_until_continue(servers):
    handle, _ = servers["tp1"]
    url, key = handle.url, handle.admin_api_key
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(generate, url, [9, 9, 9], 150)
        deadline = time.monotonic() + 30
        while _metrics(url)["running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
        status, body = http("POST", f"{url}/pause_generation", {}, key=key)
        assert status == 200 and body["interrupted"] >= 1
        out = running.result(30)["outputs"][0]
        assert out["stop_reason"] == "interrupt" and len(out["output_tokens"]) < 150
        held = pool.submit(generate, url, [9, 9, 9], 5)
        time.sleep(0.5)
        assert not held.done() and _metrics(url)["waiting"] == 1  # queued while paused
        assert http("POST", f"{url}/continue_generation", {}, key=key)[0] == 200
        assert held.result(30)["outputs"][0]["output_tokens"] == greedy(url, [9, 9, 9], 5)
