"""Inference server benchmark: decode tokens/s at batch 1 and 16, and the pause-to-resume time
of a weight update (disk and awex), on the default tiny model (not a test).

    python benchmarks/bench_inference.py [--tp 1] [--samples 5] [--new-tokens 128] [--json out.json]

Each figure is measured ``--samples`` times after a warm-up run; the first sample is dropped
and the median and min of the rest are printed. Decode tokens/s counts tokens after the first
one of each request over the time after its first token (prefill excluded); the batch-16 figure
is the sum over 16 concurrent requests divided by the wall time of their decode phase.
"Pause-to-resume" is how long the engine loop stood still for an update, as the server reports
it in ``/metrics.last_update`` (decoding resumes right after), measured while 16 requests decode;
awex moves the whole float32 model (the bound on loopback gloo is the memcpy rate), disk reads
a safetensors checkpoint.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _inference_helpers import TINY, http, make_checkpoint

from awex_fast.net import ADMIN_KEY_ENV, KVStoreServer
from awex_fast.sync import TrainingAdapter, WeightSyncPair
from python_engines.inference.server import launch_server

KEY = "bench-inference-key"


def _generate(url: str, prompt: list[int], n: int) -> dict:
    status, body = http("POST", f"{url}/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": n, "min_new_tokens": n, "greedy": True}}, timeout=600)
    if status != 200:
        raise RuntimeError(f"/generate answered {status}: {body}")
    return body["outputs"][0]


def decode_rate(url: str, batch: int, n: int) -> float:
    """Decode tokens/s of ``batch`` concurrent requests of ``n`` tokens."""
    prompts = [[(7 * i + j) % TINY["vocab_size"] for j in range(8)] for i in range(batch)]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        outs = list(pool.map(lambda p: _generate(url, p, n), prompts))
    wall = time.monotonic() - start
    if batch == 1:
        out = outs[0]
        return (n - 1) / (out["latency"] - out["ttft"])
    first = max(o["ttft"] for o in outs)  # all requests are decoding after this
    return batch * (n - 1) / max(wall - first, 1e-9)


def summary(values: list[float]) -> dict:
    """Median and min of the samples after dropping the first."""
    kept = values[1:] if len(values) > 1 else values
    return {"median": statistics.median(kept), "min": min(kept), "samples": len(kept)}


def pause_to_resume(url: str, update, n_new: int) -> float:
    """Run ``update()`` while 16 requests decode; the server's pause-to-resume time (ms)."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(_generate, url, [i + 1, 2, 3], n_new) for i in range(16)]
        deadline = time.monotonic() + 60
        while http("GET", f"{url}/metrics")[1]["running"] < 16 and time.monotonic() < deadline:
            time.sleep(0.002)
        update()
        for f in futs:
            f.result()
    return http("GET", f"{url}/metrics")[1]["last_update"]["pause_to_resume_ms"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per TP rank")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault(ADMIN_KEY_ENV, KEY)
    tmp = tempfile.TemporaryDirectory(prefix="bench_inference_")
    ckpt_a = make_checkpoint(Path(tmp.name) / "a", seed=1)
    ckpt_b = make_checkpoint(Path(tmp.name) / "b", seed=2)
    server = launch_server(ckpt_a, args.tp, admin_api_key=KEY, dtype=args.dtype, max_seq_len=512,
                           max_running=32, num_threads=args.threads)
    kv = KVStoreServer(admin_api_key=KEY).start()
    results: dict = {"tp": args.tp, "dtype": args.dtype, "model": TINY, "threads": args.threads}
    pair = None
    try:
        url = server.url
        for batch in (1, 16):
            decode_rate(url, batch, 16)  # warm-up
            rates = [decode_rate(url, batch, args.new_tokens) for _ in range(args.samples)]
            results[f"decode_tokens_per_s_batch{batch}"] = summary(rates)
        versions = iter(range(1, 10_000))

        def disk() -> None:
            status, body = http("POST", f"{url}/update_weights_from_disk",
                                {"model_path": ckpt_b, "version": next(versions)}, key=KEY)
            if status != 200:
                raise RuntimeError(body)

        results["disk_pause_to_resume_ms"] = summary(
            [pause_to_resume(url, disk, 64) for _ in range(args.samples)])
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ckpt_b, dtype=torch.float32)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        pair = WeightSyncPair("bench", kv.url, [TrainingAdapter(model, rank=0, world_size=1)],
                              [[f"{url}/tp/{r}" for r in range(args.tp)]], admin_api_key=KEY)
        pair.connect()

        def awex() -> None:
            out = pair.update_weights(next(versions))
            if out["status"] != "ok":
                raise RuntimeError(out)

        samples = [pause_to_resume(url, awex, 64) for _ in range(args.samples)]
        results["awex_pause_to_resume_ms"] = summary(samples)
        results["awex_bytes"] = nbytes
        results["awex_GBps_at_median"] = nbytes / (results["awex_pause_to_resume_ms"]["median"] / 1e3) / 1e9
    finally:
        if pair is not None:
            pair.close()
        kv.stop()
        server.shutdown()
        tmp.cleanup()
    for key, value in results.items():
        print(f"{key:32s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
