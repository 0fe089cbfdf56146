"""The README's main job runs end to end (tiny model: correctness, not timing)."""

from __future__ import annotations

import json

from awex_fast.bench import bench_main


def test_bench_runs_every_method_and_verifies(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench_main(["--model", "tiny-dense", "--iters", "1", "--bucket-mb", "1", "--json", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["verified"] is True
    assert set(summary["methods"]) == {"awex_fast", "raw", "naive"}
    assert summary["methods"]["awex_fast"]["bytes"] == summary["methods"]["raw"]["bytes"] > 0
    assert set(summary["ratios"]) == {"vs_raw", "vs_naive"}
    assert "verified bit-exact: True" in capsys.readouterr().out


def test_bench_2d_layout_with_checksums(tmp_path):
    out = tmp_path / "bench.json"
    args = [
        "--model",
        "tiny-dense",
        "--train",
        "fsdp=2,tp=2",
        "--infer",
        "tp=2,engines=2",
        "--iters",
        "1",
        "--methods",
        "awex_fast",
        "--verify",
        "--json",
        str(out),
    ]
    assert bench_main(args) == 0
    assert json.loads(out.read_text())["verified"] is True
