"""Block-FP8 quantization of a trainer's shards: fp8's torch expressions against the native
kernels (csrc/quant), the work `QuantizingSource.refresh` does each round.

A weight [rows, cols] is cut into FSDP row shards; for each shard, its per-block amax
(`piece_amax`), then its e4m3 bytes written into its region of the e4m3 tensor (torch:
``region.copy_(quantize_piece(...))`` as fp8_sender does today; native: `quantize_piece_into`).
Both give the same bytes (checked). Prints the best of ``--repeat`` runs per step in seconds
and in GB/s of weight read (the input bytes, once per step), and the torch / native ratio.

    python benchmarks/bench_fp8_quantize.py [--rows 1536 --cols 8960 --shards 2 --dtype float32]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from awex_fast.transfer import fp8
from awex_fast.transfer.fp8 import BlockGrid, merge_amax, scales_from_amax


def _best(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    """Run the comparison and print one line per step and path."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--cols", type=int, default=8960)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    w = (torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    grid = BlockGrid("w", (args.rows, args.cols))
    step = -(-args.rows // args.shards)
    shards = [((r, 0), w[r:r + step]) for r in range(0, args.rows, step)]
    assert all(fp8._native_for(p) is not None for _, p in shards), "the native kernels are not built"
    scales = scales_from_amax(merge_amax(grid, [fp8.piece_amax(p, o, grid) for o, p in shards]))
    out_torch = torch.zeros(w.shape, dtype=fp8.FP8_DTYPE)
    out_native = torch.zeros(w.shape, dtype=fp8.FP8_DTYPE)

    def amax_torch() -> None:
        for o, p in shards:
            fp8._torch_amax(p, o, grid, *grid.blocks_of(o, p.shape))

    def amax_native() -> None:
        for o, p in shards:
            fp8.piece_amax(p, o, grid)

    def quant_torch() -> None:
        for (r, _), p in shards:
            out_torch[r:r + p.shape[0]].copy_(fp8._torch_quantize(p, (r, 0), grid, scales))

    def quant_native() -> None:
        for (r, _), p in shards:
            fp8.quantize_piece_into(out_native[r:r + p.shape[0]], p, (r, 0), grid, scales)

    quant_torch()
    quant_native()
    assert torch.equal(out_torch.view(torch.uint8), out_native.view(torch.uint8)), "the paths differ"
    gb = w.numel() * w.element_size() / 1e9
    print(f"weight {args.rows}x{args.cols} {args.dtype} ({gb * 1e3:.1f} MB), {len(shards)} row shards, "
          f"{torch.get_num_threads()} torch threads; best of {args.repeat}")
    for name, t_fn, n_fn in (("amax", amax_torch, amax_native), ("quantize", quant_torch, quant_native),
                             ("both", lambda: (amax_torch(), quant_torch()),
                              lambda: (amax_native(), quant_native()))):
        t, n = _best(t_fn, args.repeat), _best(n_fn, args.repeat)
        print(f"{name:9s} torch {t:8.4f} s {gb / t:6.2f} GB/s | native {n:8.4f} s {gb / n:6.2f} GB/s | "
              f"ratio {t / n:5.1f}x")


if __name__ == "__main__":
    main()
