"""Planning benchmark: awex_fast's native planner next to Awex 0.9's TransferPlanBuilder.

For each layout (named model shapes from awex_fast.layouts.models, generated layouts from
awex_fast.layouts.synthetic) it measures, from in-memory metadata:

* per-rank planning: what one rank pays at start-up, ``build_plan`` (read, canonicalise and
  validate both sides' metadata) + ``plan.for_rank(r)``, for the first training and the first
  inference rank; Awex's ``build_local_transfer_plan`` for the same ranks;
* the whole world: ``plan.stats()`` (every pair, natively) and, with ``--all-ranks``, the sum of
  ``for_rank`` over every rank;
* beside it, metadata JSON encode / decode time and size (``metas_to_json`` / ``metas_from_json``)
  and the plan's stats (bytes, ops, buckets, imbalance and its lower bound).

Timing: one warm-up call, then ``--samples`` calls, each after ``gc.collect()``; medians of wall
and CPU (process) time are reported, the CPU figure being the robust one on a shared machine.
Awex runs in the same process when importable (see --help for the venv recipe); otherwise its
columns say so. Not a test: nothing here runs in CI.

    python benchmarks/bench_plan.py                       # 72B, Kimi-K2 EP (rules and explicit lists)
    /work/awex-venv/bin/python benchmarks/bench_plan.py --out /tmp/bench_plan.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from awex_fast.bench.awex_baseline import awex_available, quiet_awex_logs, to_awex
from awex_fast.layouts import model_spec
from awex_fast.layouts.synthetic import parse_infer, parse_train, world_metas
from awex_fast.meta import ParameterMeta, merge_metas, metas_from_json, metas_to_json
from awex_fast.plan import build_plan

# name -> (model, training layout, inference layout)
LAYOUTS: dict[str, tuple[str, str, str]] = {
    "72b": ("qwen2.5-72b", "tp8,pp4,dp2", "tp8,engines8"),  # 64 training ranks
    "72b-1024": ("qwen2.5-72b", "tp8,pp4,dp32", "tp8,engines128"),  # 1,024 training ranks
    "kimi-ep": ("kimi-k2", "ep64,pp4", "tp16,engines8,ep"),  # experts whole on one rank per engine
    "kimi-tp": ("kimi-k2", "ep64,pp4", "tp16,engines8"),  # experts TP16-split inside each engine
}
# Explicit-list twins: the same layouts as every rank's own ShardMeta list (what
# metas_from_dtensors reports on the FSDP2 path) merged with merge_metas, which packs them for the
# planner (records read in place, the overlap check native). Awex plans the same pieces (its
# metadata has no rules), so its columns are unchanged. Issue 23's goal: both >= 20x Awex 0.9.
EXPLICIT: dict[str, str] = {"72b-explicit": "72b", "kimi-ep-explicit": "kimi-ep"}
DEFAULT = "72b,72b-explicit,72b-1024,kimi-ep,kimi-ep-explicit"


def explicit_lists(metas: list) -> list:
    """``metas`` with every rule expanded, reported rank by rank and merged (`merge_metas`)."""
    per: dict[int, list] = {}
    for m in metas:
        by: dict[int, list] = {}
        for s in m.pieces():
            by.setdefault(s.rank, []).append(s)
        for r, ss in by.items():
            per.setdefault(r, []).append(ParameterMeta(m.name, m.global_shape, m.dtype, tuple(ss)))
    return merge_metas(per)

AWEX_VENV = """\
Awex 0.9 in a separate venv, with this checkout on PYTHONPATH (nothing of Awex in the project's venv):
  python -m venv /work/awex-venv
  /work/awex-venv/bin/pip install torch==2.13.0 numpy
  /work/awex-venv/bin/pip install awex==0.9.0 'megatron-core==0.16.*' transformers requests psutil aiohttp
  PYTHONPATH=$PWD /work/awex-venv/bin/python benchmarks/bench_plan.py
"""


def timed(fn: Callable[[], Any], samples: int, warmup: int = 1) -> tuple[dict[str, float], Any]:
    """Median / min wall and CPU seconds of ``fn()`` over ``samples`` calls after ``warmup``."""
    out = None
    for _ in range(warmup):
        gc.collect()
        out = fn()
    walls, cpus = [], []
    for _ in range(samples):
        gc.collect()
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        cpus.append(time.process_time() - c)
        walls.append(time.perf_counter() - w)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "wall_min_s": min(walls), "cpu_min_s": min(cpus)}, out  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Awex 0.9


def bench_awex(train: list, infer: list, I: int, T: int, engines: int, tp: int, ranks: list[int],
               samples: int) -> dict[str, Any]:  # fmt: skip
    """Awex 0.9 per-rank planning for ``ranks`` (transfer ranks) on the same layout."""
    from awex.transfer.transfer_plan import TransferPlanBuilder

    quiet_awex_logs()
    t0 = time.perf_counter()
    a_train, a_infer = to_awex(train, I), to_awex(infer, 0, engine_ranks=tp)
    res: dict[str, Any] = {"convert_s": time.perf_counter() - t0, "ranks": {}}
    builder = TransferPlanBuilder(infer_world_size=I, train_world_size=T, num_infer_engines=engines)
    quiet_awex_logs()
    for r in ranks:
        t, plan = timed(lambda r=r: builder.build_local_transfer_plan(a_infer, a_train, r), samples, warmup=0)
        t["ops"] = sum(len(v) for v in plan.operations.values())
        t["peers"] = len(plan.operations)
        res["ranks"][r] = t
    return res


# ---------------------------------------------------------------------------------------------
# awex_fast


def bench_layout(
    name: str, samples: int, awex_samples: int, with_awex: bool, all_ranks: bool
) -> dict[str, Any]:
    model, tspec, ispec = LAYOUTS[EXPLICIT.get(name, name)]
    spec = model_spec(model)
    tl, il = parse_train(tspec), parse_infer(ispec)
    I, T = il.world_size, tl.world_size
    res: dict[str, Any] = {"layout": name, "model": model, "train": tspec, "infer": ispec,
                           "tensors": len(spec.tensors), "train_ranks": T, "infer_ranks": I}  # fmt: skip
    t0 = time.perf_counter()
    train, infer = world_metas(spec, tl, il)
    res["layout_gen_s"] = time.perf_counter() - t0
    rule_metas = train, infer
    if name in EXPLICIT:
        t0 = time.perf_counter()
        train, infer = explicit_lists(train), explicit_lists(infer)
        res["explicit"] = {"merge_s": time.perf_counter() - t0,
                           "pieces": sum(len(m.shards) for m in train) + sum(len(m.shards) for m in infer)}

    enc, blobs = timed(lambda: (metas_to_json(train), metas_to_json(infer)), max(1, samples // 2))
    dec, _ = timed(lambda: (metas_from_json(blobs[0]), metas_from_json(blobs[1])), max(1, samples // 2))
    res["json"] = {"bytes": len(blobs[0]) + len(blobs[1]), "encode": enc, "decode": dec}

    build, plan = timed(lambda: build_plan(train, infer), samples)
    res["build_plan"] = build
    ranks = [I, 0]  # first training rank, first inference rank
    res["ranks"] = {}
    for r in ranks:
        t, rp = timed(lambda r=r: plan.for_rank(r), samples)
        t["ops"] = len(rp.ops)
        t["peers"] = len({b.peer for b in rp.sends + rp.recvs})
        t["buckets"] = len(rp.sends) + len(rp.recvs)
        t["per_rank_cpu_s"] = build["cpu_s"] + t["cpu_s"]
        t["per_rank_wall_s"] = build["wall_s"] + t["wall_s"]
        res["ranks"][r] = t
    st_t, stats = timed(lambda: build_plan(train, infer).stats(), max(1, samples // 2))
    res["world_stats"] = st_t
    skip = ("per_rank_send", "per_rank_recv", "train_only_names")
    res["stats"] = {k: v for k, v in stats.items() if k not in skip}
    if all_ranks:
        w, c = time.perf_counter(), time.process_time()
        for r in plan.receivers + plan.senders:
            plan.for_rank(r)
        res["all_ranks_for_rank"] = {"wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c}
    if with_awex:
        res["awex"] = bench_awex(*rule_metas, I, T, il.engines, il.tp, ranks, awex_samples)
    return res


def _ms(s: float) -> str:
    return f"{s * 1e3:9.1f}"


def report(results: list[dict[str, Any]]) -> str:
    """Human-readable table of `bench_layout` results."""
    lines = []
    for r in results:
        st = r["stats"]
        lines += [
            f"== {r['layout']}: {r['model']} ({r['tensors']} tensors), training {r['train']} "
            f"({r['train_ranks']} ranks) -> inference {r['infer']} ({r['infer_ranks']} ranks)",
            *([f"   explicit lists: {r['explicit']['pieces']} pieces, expanded + merge_metas "
               f"{r['explicit']['merge_s']:.2f} s (untimed setup)"] if "explicit" in r else []),
            f"   metadata JSON {r['json']['bytes'] / 2**20:.1f} MiB: encode "
            f"{_ms(r['json']['encode']['cpu_s'])} ms, decode {_ms(r['json']['decode']['cpu_s'])} ms (CPU)",
            f"   build_plan          wall {_ms(r['build_plan']['wall_s'])} ms   cpu "
            f"{_ms(r['build_plan']['cpu_s'])} ms",
        ]  # fmt: skip
        for rank, t in r["ranks"].items():
            side = "training" if int(rank) >= r["infer_ranks"] else "inference"
            line = (f"   rank {rank:>5} ({side:9}) for_rank wall {_ms(t['wall_s'])} ms  cpu "
                    f"{_ms(t['cpu_s'])} ms;"
                    f" per rank (build+for_rank) cpu {_ms(t['per_rank_cpu_s'])} ms; {t['ops']} ops, "
                    f"{t['peers']} peers, {t['buckets']} buckets")  # fmt: skip
            lines.append(line)
            aw = r.get("awex", {}).get("ranks", {}).get(rank)
            if aw:
                ratio = aw["cpu_s"] / t["per_rank_cpu_s"]
                wratio = aw["wall_s"] / t["per_rank_wall_s"]
                lines.append(
                    f"               Awex 0.9 build_local_transfer_plan wall {_ms(aw['wall_s'])} ms  cpu "
                    f"{_ms(aw['cpu_s'])} ms; {aw['ops']} ops, {aw['peers']} peers -> {ratio:.1f}x (cpu), "
                    f"{wratio:.1f}x (wall) faster"
                )  # fmt: skip
        ws = r["world_stats"]
        lines.append(f"   world stats()       wall {_ms(ws['wall_s'])} ms   cpu {_ms(ws['cpu_s'])} ms")
        if "all_ranks_for_rank" in r:
            a = r["all_ranks_for_rank"]
            lines.append(f"   for_rank x all ranks wall {_ms(a['wall_s'])} ms   cpu {_ms(a['cpu_s'])} ms")
        lines.append(
            f"   bytes {st['total_bytes'] / 2**30:.1f} GiB, ops {st['ops']}, buckets {st['buckets']}, pairs "
            f"{st['pairs']}, send max/mean {st['send_bytes_max'] / 2**30:.2f}/"
            f"{st['send_bytes_mean'] / 2**30:.2f} GiB,"
            f" imbalance {st['imbalance']:.4f} (bound {st['imbalance_bound']:.4f})"
        )
        if "awex" in r:
            lines.append(f"   (Awex metadata conversion, untimed: {r['awex']['convert_s']:.1f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (and write JSON with --out)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=AWEX_VENV
    )
    names = ", ".join([*LAYOUTS, *EXPLICIT])
    parser.add_argument("--layouts", default=DEFAULT, help=f"comma list of {names}")
    parser.add_argument("--samples", type=int, default=5, help="timed calls per measurement (+1 warm-up)")
    parser.add_argument("--awex-samples", type=int, default=2, help="timed Awex calls per rank")
    parser.add_argument("--no-awex", action="store_true", help="skip Awex even if it is installed")
    parser.add_argument("--all-ranks", action="store_true", help="also time for_rank over every rank")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    with_awex = not args.no_awex and awex_available()
    if not args.no_awex and not with_awex:
        print("awex is not importable here: awex_fast only.\n" + AWEX_VENV, file=sys.stderr)
    results = []
    for name in filter(None, args.layouts.split(",")):
        results.append(bench_layout(name, args.samples, args.awex_samples, with_awex, args.all_ranks))
        print(report(results[-1:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
