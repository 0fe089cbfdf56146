"""pytest-benchmark form of `awex-fast bench` (never part of CI: testpaths is tests/).

Each case runs the whole multi-process bench once (all methods in one run, so the ratios are
measured together) and records its per-method medians in the benchmark's extra_info.

    pytest benchmarks/test_bench_sync.py --benchmark-only -s
"""

from __future__ import annotations

import json

import pytest

from awex_fast.bench import bench_main

LAYOUTS = {
    "dense_default": [],
    "dense_2d": ["--train", "fsdp=2,tp=2", "--infer", "tp=4,engines=1", "--layers", "4"],
    "small_moe": ["--model", "small-moe", "--train", "fsdp=2", "--infer", "tp=2,engines=1"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync(benchmark, layout, tmp_path):
    out = tmp_path / "bench.json"
    args = [*LAYOUTS[layout], "--json", str(out)]
    rc = benchmark.pedantic(bench_main, args=(args,), rounds=1, iterations=1)
    assert rc == 0
    summary = json.loads(out.read_text())
    benchmark.extra_info.update({m: v["median_s"] for m, v in summary["methods"].items()})
    benchmark.extra_info["ratios"] = summary["ratios"]
