"""Throughput of the native batched copy against one contiguous ``Tensor.copy_`` of the same bytes.

Cases (issue "Build system, native batched copy kernels"):
  a) 4 boxes of 64 MiB, b) 4096 boxes of 64 KiB, c) a [8192, 8192] float32 tensor split into 8
  column blocks of 1024 columns (4 KiB contiguous runs).
For each case: pack (gather into one bucket) and unpack (scatter back), both through a prebuilt
CopyProgram (what the executor replays every update) and through pack()/unpack() (descriptors
rebuilt every call), next to the baseline measured in the same run.

    python benchmarks/bench_copy.py [--device cpu|cuda] [--json PATH] [--samples N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import awex_fast as af
from awex_fast.transfer import boxcopy as afc

MiB = 1 << 20


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(fn: Callable[[], None], device: str, samples: int) -> float:
    """Median seconds of ``fn`` over ``samples`` runs after one dropped warm-up run."""
    fn()
    _sync(device)
    times = []
    for _ in range(samples):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_case(name: str, device: str) -> tuple[list[torch.Tensor], int]:
    """Views of one case and their total bytes."""
    if name == "a_4x64MiB":
        views = [torch.randn(16 * MiB, device=device) for _ in range(4)]
    elif name == "b_4096x64KiB":
        base = torch.randn(4096, 16 * 1024, device=device)
        views = list(base.unbind(0))
    elif name == "c_8192sq_8colblocks":
        base = torch.randn(8192, 8192, device=device)
        views = [base[:, 1024 * k : 1024 * (k + 1)] for k in range(8)]
    else:
        raise ValueError(name)
    return views, sum(v.numel() * v.element_size() for v in views)


def run_case(name: str, device: str, samples: int, wire: torch.dtype = torch.float32) -> dict:
    """Times for one case: baseline, pack/unpack through programs and through the plain API.

    ``wire`` other than float32 makes pack a cast (float32 views -> ``wire`` bucket) and unpack
    the cast back; the baseline is then torch's own contiguous cast of the same element count."""
    views, nbytes = make_case(name, device)
    numel = nbytes // 4
    out = torch.empty(numel, dtype=wire, device=device)
    src_flat, dst_flat = torch.randn(numel, device=device), torch.empty(numel, dtype=wire, device=device)
    offsets, acc = [], 0
    for v in views:
        offsets.append(acc)
        acc += v.numel() * wire.itemsize
    buf = out.view(torch.uint8)
    pack_prog = afc.gather_program(views, buf, offsets, wire)
    unpack_prog = afc.scatter_program(buf, offsets, wire, views)
    t = {
        "baseline_copy": bench(lambda: dst_flat.copy_(src_flat), device, samples),
        "pack_program": bench(pack_prog.run, device, samples),
        "unpack_program": bench(unpack_prog.run, device, samples),
        "pack_api": bench(lambda: af.copy.pack(views, out), device, samples),
        "unpack_api": bench(lambda: af.copy.unpack(out, views), device, samples),
    }
    gbps = {k: nbytes / v / 1e9 for k, v in t.items()}
    return {
        "case": name,
        "bytes": nbytes,
        "boxes": len(views),
        "seconds": t,
        "GBps": gbps,
        "ratio_vs_copy": {k: t["baseline_copy"] / v for k, v in t.items() if k != "baseline_copy"},
    }


def main(argv: list[str] | None = None) -> int:
    """Run every case and print a table (and JSON when asked)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--json", default=None)
    p.add_argument("--cases", default="a_4x64MiB,b_4096x64KiB,c_8192sq_8colblocks")
    p.add_argument(
        "--wire-dtype", default="float32", help="bfloat16 / float16: pack casts (baseline: torch's cast)"
    )
    args = p.parse_args(argv)
    wire = getattr(torch, args.wire_dtype)
    results = [run_case(c, args.device, args.samples, wire) for c in args.cases.split(",")]
    print(f"device={args.device} wire={args.wire_dtype} threads={afc.num_threads()} build={af.build_info()}")
    print(
        f"{'case':22} {'copy_ GB/s':>10} {'pack':>7} {'unpack':>7} {'pack()':>7} {'unpack()':>8} (x copy_)"
    )
    for r in results:
        q = r["ratio_vs_copy"]
        print(
            f"{r['case']:22} {r['GBps']['baseline_copy']:10.2f} {q['pack_program']:7.2f} "
            f"{q['unpack_program']:7.2f} {q['pack_api']:7.2f} {q['unpack_api']:8.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "build": af.build_info(), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
