"""`awex-fast bench`: sync latency of a training job -> inference engines on this machine.

The parent process spawns the training and inference ranks as fresh Python processes on
127.0.0.1 (`python -m awex_fast.bench.worker SPEC`, JSON spec, no pickle), which rendezvous on a
TCPStore the parent hosts. Every method is timed on the same processes in the same run:

* ``awex_fast``: the planned, bucketed, double-buffered executor (casting to the inference dtype);
* ``raw``: the transport's own bound: each (sender, receiver) pair of the plan sends one
  contiguous buffer of the bytes that pair carries, all pairs concurrently;
* ``raw_cast`` (when the training dtype differs): ``raw`` after each sender casts its buffers
  from the training dtype in one contiguous native copy, the bound for any method that casts;
* ``naive``: what frameworks do today: each full parameter is gathered on training rank 0 and
  sent to every inference rank, one parameter at a time;
* ``awex``: Awex 0.9's own plan and execution (awex_fast.bench.awex_baseline) over a gloo world of the
  same processes, when awex is importable. Awex cannot cast, so it sends training weights
  already in the inference dtype (copies made before timing), and the table says so.

The methods interleave: iteration ``i`` runs them rotated by ``i`` (A B C, B C A, ...; iteration 0
is an untimed warm-up), so load that comes and goes on the host falls on all of them, and each
ratio is reported as the ratio of medians plus its min / median / max over iterations.
After the timed iterations each method that writes the inference weights (awex_fast, naive,
awex) runs once more and the inference weights are checked bit-exactly against the training
weights cast to the inference dtype (regenerated independently from their seeds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("awex_fast", "raw", "raw_cast", "naive", "awex")


def parse_kv(text: str, keys: dict[str, int]) -> dict[str, int]:
    """``"fsdp=2,tp=1"`` -> {"fsdp": 2, "tp": 1}, with defaults from ``keys``; unknown keys raise."""
    out = dict(keys)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in keys or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad layout item {part!r}: expected one of {sorted(keys)} = positive integer")
        out[key] = int(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `awex-fast bench`."""
    p = argparse.ArgumentParser(
        prog="awex-fast bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engine", default="awex", choices=["awex", "vllm"],
                   help="vllm: time routes into a real vLLM server (awex_fast.bench.vllm)")
    p.add_argument("--model", default="qwen2.5-0.5b", help="named model shape (awex_fast.layouts.models)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--train", default="fsdp=2,tp=1", help="training layout, e.g. fsdp=2,tp=2")
    p.add_argument("--infer", default="tp=2,engines=1", help="inference layout, e.g. tp=4,engines=2")
    p.add_argument("--train-dtype", default="float32")
    p.add_argument("--dtype", default="bfloat16", help="inference dtype")
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--message-kb", type=int, default=None, help="executor message size (KiB)")
    p.add_argument("--solo-kb", type=int, default=None, help="ops this big travel alone (KiB)")
    p.add_argument("--copy-threads", type=int, default=None, help="native copy threads per rank")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--backend", default="gloo", choices=["gloo", "ipc", "nccl", "native-nccl"])
    p.add_argument(
        "--methods",
        default=None,
        help="comma list of " + ", ".join(METHODS) + " (default: all; awex only where it is installed)",
    )
    p.add_argument("--verify", action="store_true", help="per-bucket checksums (costs time)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of latency per method (matplotlib)")
    p.add_argument("--trace", default=None, help="write the executor's per-bucket trace (JSON)")
    p.add_argument("--profile", action="store_true",
                   help="profile one more sync per rank: CPU seconds by category (pack/unpack, "
                        "transport waits, Python control, ...)")
    p.add_argument("--timeout", type=float, default=600.0)
    return p


def _spawn(spec: dict, world: int, tmp: Path) -> list[subprocess.Popen]:
    procs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    # Every rank runs on this host, as under torchrun: each copy pool takes its share of the CPUs.
    env["LOCAL_WORLD_SIZE"] = str(world)
    for rank in range(world):
        path = tmp / f"spec{rank}.json"
        path.write_text(json.dumps({**spec, "rank": rank, "result": str(tmp / f"result{rank}.json")}))
        log = (tmp / f"log{rank}.txt").open("wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "awex_fast.bench.worker", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp,
            )
        )
    return procs


def _wait(procs: list[subprocess.Popen], tmp: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            rank = bad[0] if bad else next(r for r, c in enumerate(codes) if c is None)
            log = (tmp / f"log{rank}.txt").read_text(errors="replace")[-4000:]
            why = f"exited with {codes[rank]}" if bad else f"did not finish in {timeout:.0f}s"
            raise RuntimeError(f"bench rank {rank} {why}:\n{log}")
        if all(c == 0 for c in codes):
            return
        time.sleep(0.05)


def _paired_spread(base: list[float], ours: list[float]) -> dict[str, float]:
    """min / median / max over iterations of baseline seconds / awex_fast seconds: the methods
    run interleaved, so iteration ``i`` of each ran side by side under the same host load."""
    per_iter = [b / o for b, o in zip(base, ours, strict=True) if o > 0]
    if not per_iter:
        return {"min": 0.0, "median": 0.0, "max": 0.0}
    return {"min": min(per_iter), "median": statistics.median(per_iter), "max": max(per_iter)}


def summarize(results: list[dict], spec: dict) -> dict:
    """Per-method timings (max over ranks per iteration), ratios and the layout, as JSON."""
    methods = {}
    for m in spec["methods"]:
        per_iter = [max(r["times"][m][i] for r in results) for i in range(spec["iters"])]
        # CPU seconds of every rank's process (all threads) per sync: on a CPU-bound host this,
        # not the wire, is what a method spends.
        cpu_iter = [sum(r["cpu"][m][i] for r in results) for i in range(spec["iters"])]
        nbytes = results[0]["bytes"][m]
        med = statistics.median(per_iter)
        p90 = sorted(per_iter)[min(len(per_iter) - 1, round(0.9 * (len(per_iter) - 1)))]
        methods[m] = {
            "seconds": per_iter,
            "median_s": med,
            "p90_s": p90,
            "bytes": nbytes,
            "GBps": nbytes / med / 1e9 if med > 0 else 0.0,
            "cpu_s": statistics.median(cpu_iter),
            "cpu_s_by_rank": [statistics.median(r["cpu"][m]) for r in results],
        }
    ratios: dict[str, float] = {}
    spread: dict[str, dict[str, float]] = {}
    ours = methods.get("awex_fast")
    for base in ("raw", "raw_cast", "naive", "awex"):
        if ours and base in methods:
            ratios[f"vs_{base}"] = methods[base]["median_s"] / ours["median_s"]
            spread[f"vs_{base}"] = _paired_spread(methods[base]["seconds"], ours["seconds"])
    if "awex" in methods and spec["train_dtype"] != spec["dtype"]:
        methods["awex"]["note"] = f"{spec['dtype']} training weights (Awex cannot cast)"
    verified = all(r.get("verified", True) for r in results)
    return {
        "layout": {
            k: spec[k]
            for k in (
                "model",
                "layers",
                "train",
                "infer",
                "train_dtype",
                "dtype",
                "bucket_mb",
                "backend",
                "iters",
            )
        },
        "plan": results[0].get("plan", {}),
        "methods": methods,
        "ratios": ratios,
        "ratio_spread": spread,
        "verified": verified,
        "staging_bytes": max(r.get("staging_bytes", 0) for r in results),
        "profile": [{"rank": r["rank"], **r["profile"]} for r in results if r.get("profile")],
    }


def print_table(summary: dict) -> None:
    """The one table `awex-fast bench` prints."""
    lay = summary["layout"]
    print(
        f"model={lay['model']} layers={lay['layers']} train={lay['train']} ({lay['train_dtype']}) "
        f"infer={lay['infer']} ({lay['dtype']}) bucket={lay['bucket_mb']}MiB backend={lay['backend']}"
    )
    print(
        f"{'method':10} {'bytes':>14} {'median s':>9} {'p90 s':>8} {'GB/s':>7} {'cpu s':>6}"
        "  baseline s / awex_fast s"
    )
    ours = summary["methods"].get("awex_fast")
    for name, m in summary["methods"].items():
        ratio = ""
        if ours and name != "awex_fast":
            s = summary["ratio_spread"][f"vs_{name}"]
            ratio = f"{m['median_s'] / ours['median_s']:.2f}x ({s['min']:.2f}-{s['max']:.2f} per iteration)"
        print(
            f"{name:10} {m['bytes']:14,d} {m['median_s']:9.3f} {m['p90_s']:8.3f} {m['GBps']:7.2f}"
            f" {m['cpu_s']:6.2f}  {ratio}" + (f"  [{m['note']}]" if m.get("note") else "")
        )
    print(
        f"verified bit-exact: {summary['verified']}  ratios: "
        + ", ".join(f"{k}={v:.2f}" for k, v in summary["ratios"].items())
    )


def print_profile(profile: list[dict], n_infer: int) -> None:
    """`--profile`: one more sync per method, CPU seconds by category summed over the ranks of
    each side (`awex_fast.bench.profile`: the main thread by function, then the helper threads,
    the process's user / kernel split), then each side's costliest main-thread functions."""
    from awex_fast.bench.profile import CATEGORIES

    methods = [m for m in ("awex_fast", "raw", "raw_cast") if m in profile[0]]
    print("profile (one more sync each; CPU seconds summed over the ranks of a side, wall the slowest rank)")
    columns = (*CATEGORIES, "user_s", "sys_s", "cpu_s", "wall_s")
    short = {"native_runner": "runner", "transport_wait": "t_wait", "transport_post": "t_post",
             "copy_threads": "copy_thr", "transport_threads": "transp_thr", "other_threads": "other_thr"}
    print(f"{'method':10} {'side':9} " + " ".join(f"{short.get(c, c):>10}" for c in columns))
    for method in methods:
        for side, ranks in (("inference", [p for p in profile if p["rank"] < n_infer]),
                            ("training", [p for p in profile if p["rank"] >= n_infer])):
            cols = [sum(p[method][c] for p in ranks) for c in columns[:-1]]
            cols.append(max(p[method]["wall_s"] for p in ranks))
            print(f"{method:10} {side:9} " + " ".join(f"{v:10.4f}" for v in cols))
    for side, rank in (("inference", 0), ("training", n_infer)):
        top = next(p for p in profile if p["rank"] == rank)["awex_fast"]["top"]
        print(f"awex_fast, rank {rank} ({side}): costliest functions by own CPU time (main thread)")
        for name, seconds in top:
            print(f"  {seconds * 1e3:9.2f} ms  {name[-100:]}")


def plot(summary: dict, path: str) -> None:
    """PNG of seconds per sync for each method (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; --plot skipped", file=sys.stderr)
        return
    names = list(summary["methods"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [summary["methods"][n]["median_s"] for n in names])
    ax.set_ylabel("seconds per sync (median)")
    ax.set_title(
        f"{summary['layout']['model']}: {summary['layout']['train']} -> {summary['layout']['infer']}"
    )
    fig.tight_layout()
    fig.savefig(path)


def bench_main(argv: list[str] | None = None) -> int:
    """Entry point of `awex-fast bench` (``--engine vllm``: `awex_fast.bench.vllm`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if ("--engine" in argv and argv[argv.index("--engine") + 1 :][:1] == ["vllm"]) or "--engine=vllm" in argv:
        from awex_fast.bench.vllm import bench_vllm_main

        return bench_vllm_main(argv)
    args = build_parser().parse_args(argv)
    import torch.distributed as dist

    train = parse_kv(args.train, {"fsdp": 1, "tp": 1})
    infer = parse_kv(args.infer, {"tp": 1, "engines": 1})
    from awex_fast.bench.awex_baseline import awex_available

    if args.methods is None:
        methods = [m for m in METHODS if m != "awex" or awex_available()]
        if args.train_dtype == args.dtype:  # nothing to cast: raw_cast would be raw again
            methods.remove("raw_cast")
    else:
        methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if "awex" in methods and not awex_available():
        raise SystemExit("--methods awex: awex is not importable here (pip install awex==0.9.0, see README)")
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    n_train = train["fsdp"] * train["tp"]
    n_infer = infer["tp"] * infer["engines"]
    spec = {
        "model": args.model,
        "layers": args.layers,
        "train": train,
        "infer": infer,
        "train_dtype": args.train_dtype,
        "dtype": args.dtype,
        "bucket_mb": args.bucket_mb,
        "iters": args.iters,
        "backend": args.backend,
        "methods": methods,
        "verify": args.verify,
        "port": store.port,
        "world": n_train + n_infer,
        "n_infer": n_infer,
        "timeout": args.timeout,
        "trace": bool(args.trace),
        "profile": bool(args.profile),
        "message_bytes": args.message_kb << 10 if args.message_kb else None,
        "solo_bytes": args.solo_kb << 10 if args.solo_kb else None,
        "copy_threads": args.copy_threads,
    }
    with tempfile.TemporaryDirectory(prefix="awex_bench_") as tmp_name:
        tmp = Path(tmp_name)
        procs = _spawn(spec, spec["world"], tmp)
        try:
            _wait(procs, tmp, args.timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        results = [json.loads((tmp / f"result{r}.json").read_text()) for r in range(spec["world"])]
    summary = summarize(results, spec)
    print_table(summary)
    if summary["profile"]:
        print_profile(summary["profile"], spec["n_infer"])
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if args.trace:
        Path(args.trace).write_text(json.dumps([r.get("trace", []) for r in results]))
    if args.plot:
        plot(summary, args.plot)
    return 0 if summary["verified"] else 1
