"""``awex-fast``: one entry point, one subcommand per tool.

``awex-fast plan`` plans a named model (awex_fast.layouts.models) between two generated layouts
(awex_fast.layouts.synthetic) and prints the plan's stats; ``bench``, ``kv-server`` and
``gateway`` hand their arguments to the modules that own them. Subcommand modules are imported
only when chosen, so ``awex-fast plan`` never imports aiohttp or starts a transport.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

# name -> (module, function taking argv and returning an exit code, one-line help)
_SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "plan": ("awex_fast.cli", "plan_main", "plan a named model between two layouts and print stats"),
    "bench": ("awex_fast.bench.run", "bench_main", "measure weight-sync latency and bandwidth"),
    "kv-server": ("awex_fast.net.kv_server", "kv_server_main", "serve the HTTP KV store for metadata"),
    "gateway": ("awex_fast.sync.gateway", "gateway_main", "run the pair controller's HTTP gateway"),
}


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.3f} GiB"


def plan_table(stats: dict, extra: Sequence[tuple[str, str]] = ()) -> str:
    """The stats of `awex_fast.plan.planner.Plan.stats` as an aligned two-column table."""
    rows = [
        *extra,
        ("parameters planned", f"{stats['params']}"),
        ("only on the training side", f"{len(stats['train_only_names'])}"),
        ("senders / receivers", f"{stats['senders']} / {stats['receivers']}"),
        ("total bytes (receiver dtypes)", _gib(stats["total_bytes"])),
        ("ops / buckets / pairs", f"{stats['ops']} / {stats['buckets']} / {stats['pairs']}"),
        ("send bytes per rank max / mean", f"{_gib(stats['send_bytes_max'])} / "
                                           f"{_gib(stats['send_bytes_mean'])}"),
        ("recv bytes per rank max / mean", f"{_gib(stats['recv_bytes_max'])} / "
                                           f"{_gib(stats['recv_bytes_mean'])}"),
        ("imbalance (max / mean sender)", f"{stats['imbalance']:.4f}"),
        ("  lower bound for any choice", f"{stats['imbalance_bound']:.4f}"),
        ("bucket bytes", f"{stats['bucket_bytes']}"),
        ("build_plan time", f"{stats['build_time_s'] * 1e3:.1f} ms"),
        ("world stats time", f"{stats['stats_time_s'] * 1e3:.1f} ms"),
        ("digest", stats["digest"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


# FP8 weights travel with their scales: one float32 per 128 x 128 block (DeepSeek-V3 / Kimi-K2
# block quantisation) when the model lists no scale tensors of its own.
FP8_SCALE_OVERHEAD = 4 / (128 * 128)


def projected_sync(stats: dict, link_gbps: float, nics_per_rank: int = 1, fp8: bool = False) -> dict:
    """Projected seconds of one sync from a plan's stats: the busiest sender's and the busiest
    receiver's bytes over one rank's link rate (``link_gbps`` Gbit/s per NIC x ``nics_per_rank``),
    transfers of all pairs overlapping and nothing else limiting. ``bound_s`` is what any plan of
    this layout could reach: receivers' bytes are fixed by the layout, and no replica choice
    makes the busiest sender send less than ``imbalance_bound`` x the mean. ``fp8`` (inference
    dtype of 1 byte) adds the block scales (`FP8_SCALE_OVERHEAD`) to every byte count."""
    if link_gbps <= 0 or nics_per_rank < 1:
        raise ValueError(f"link_gbps must be > 0 and nics_per_rank >= 1, got {link_gbps}, {nics_per_rank}")
    rate = link_gbps * 1e9 / 8 * nics_per_rank  # bytes/s per rank
    scale = 1 + FP8_SCALE_OVERHEAD if fp8 else 1.0
    send, recv = stats["send_bytes_max"] * scale, stats["recv_bytes_max"] * scale
    bound_send = stats["imbalance_bound"] * stats["send_bytes_mean"] * scale
    return {
        "link_gbps": link_gbps, "nics_per_rank": nics_per_rank, "rank_bytes_per_s": rate,
        "send_s": send / rate, "recv_s": recv / rate, "projected_s": max(send, recv) / rate,
        "bound_s": max(bound_send, recv) / rate, "imbalance": stats["imbalance"],
        "total_bytes": stats["total_bytes"] * scale, "fp8_scales": fp8,
    }  # fmt: skip


def projection_rows(proj: dict) -> list[tuple[str, str]]:
    """`projected_sync` as rows of `plan_table`."""
    link = f"{proj['link_gbps']:g} Gbit/s x {proj['nics_per_rank']} per rank"
    return [
        ("link", f"{link} = {proj['rank_bytes_per_s'] / 1e9:.2f} GB/s"
                 + (" (FP8 + block scales)" if proj["fp8_scales"] else "")),
        ("busiest sender / receiver", f"{proj['send_s']:.3f} s / {proj['recv_s']:.3f} s"),
        ("projected sync time", f"{proj['projected_s']:.3f} s (imbalance {proj['imbalance']:.4f})"),
        ("  lower bound for any plan", f"{proj['bound_s']:.3f} s"),
    ]  # fmt: skip


def _plan_parser() -> argparse.ArgumentParser:
    from awex_fast.layouts.models import DEFAULT_MODEL, model_names

    parser = argparse.ArgumentParser(
        prog="awex-fast plan",
        description="Plan a weight sync of a named model between generated layouts; print stats.",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"one of {', '.join(model_names())}")
    parser.add_argument("--layers", type=int, default=None, help="override the decoder layer count")
    parser.add_argument("--train", default="tp2,dp2", help="training layout, e.g. tp8,pp4,dp2 or ep64,pp4")
    parser.add_argument("--infer", default="tp2,engines2", help="inference layout, e.g. tp16,engines8,ep")
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="bucket size in MiB (default 256)")
    parser.add_argument("--rank", type=int, action="append", default=[],
                        help="also time for_rank(RANK) and show its buckets (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the stats as JSON")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="project the sync time over links of this many Gbit/s per NIC")
    parser.add_argument("--nics-per-rank", type=int, default=1, help="NICs per rank (default 1)")
    return parser


def _rank_rows(plan: Any, ranks: Sequence[int]) -> list[dict[str, Any]]:
    """``for_rank`` of each rank, timed, with its op, bucket and byte counts."""
    rows = []
    for r in ranks:
        rp = plan.for_rank(r)
        rows.append({
            "rank": r, "time_s": rp.plan_time_s, "ops": len(rp.ops), "send_buckets": len(rp.sends),
            "recv_buckets": len(rp.recvs), "send_bytes": rp.send_bytes, "recv_bytes": rp.recv_bytes,
        })  # fmt: skip
    return rows


def _plan_text(args: argparse.Namespace, model: Any, train: Any, infer: Any, layout_s: float,
               stats: dict, per_rank: list[dict], proj: dict | None) -> str:
    """The human-readable table of `plan_main`."""
    extra = [
        ("model", f"{model.name}: {len(model.tensors)} tensors, {model.num_params / 1e9:.2f}B params"),
        ("training layout", f"{args.train} ({train.world_size} ranks, from rank {infer.world_size})"),
        ("inference layout", f"{args.infer} ({infer.world_size} ranks, from rank 0)"),
        ("layout generation", f"{layout_s * 1e3:.1f} ms"),
    ]
    for pr in per_rank:
        extra.append((
            f"for_rank({pr['rank']})",
            f"{pr['time_s'] * 1e3:.2f} ms, {pr['ops']} ops, {pr['send_buckets']} send / "
            f"{pr['recv_buckets']} recv buckets",
        ))  # fmt: skip
    table = plan_table(stats, extra)
    if proj is not None:
        width = max(len(line.split("  ")[0]) for line in table.splitlines())
        table += "\n" + "\n".join(f"{k.ljust(width)}  {v}" for k, v in projection_rows(proj))
    return table


def plan_main(argv: Sequence[str] | None = None) -> int:
    """``awex-fast plan --model NAME --train SPEC --infer SPEC``: print the plan's stats table
    (or JSON with ``--json``). Exit codes: 0, 2 for bad arguments or metadata the planner
    rejects (the message names the parameter)."""
    from awex_fast.layouts.models import model_spec
    from awex_fast.layouts.synthetic import parse_infer, parse_train, world_metas
    from awex_fast.plan import PlanError, build_plan, unsupported_casts

    args = _plan_parser().parse_args(argv)
    if args.link_gbps is not None and (args.link_gbps <= 0 or args.nics_per_rank < 1):
        print("awex-fast plan: bad arguments: --link-gbps must be > 0 and --nics-per-rank >= 1",
              file=sys.stderr)
        return 2
    try:
        model = model_spec(args.model, args.layers)
        train, infer = parse_train(args.train), parse_infer(args.infer)
        t0 = time.perf_counter()
        train_metas, infer_metas = world_metas(model, train, infer)
        layout_s = time.perf_counter() - t0
        # a plan studied, not executed: a cast the copy layer lacks (e.g. to FP8) is only noted
        plan = build_plan(train_metas, infer_metas, int(args.bucket_mb * (1 << 20)), check_casts=False)
    except (KeyError, ValueError) as exc:  # PlanError is a ValueError
        kind = "plan" if isinstance(exc, PlanError) else "arguments"
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"awex-fast plan: bad {kind}: {msg}", file=sys.stderr)
        return 2
    cast_note = unsupported_casts(plan)
    if cast_note is not None:
        print(f"awex-fast plan: note: this plan cannot run yet: {cast_note}", file=sys.stderr)
    per_rank = _rank_rows(plan, args.rank or [0, infer.world_size])
    stats = plan.stats()
    proj = None
    if args.link_gbps is not None:
        fp8 = (infer.dtype or "").startswith("float8")
        proj = projected_sync(stats, args.link_gbps, args.nics_per_rank, fp8)
    if args.json:
        out = {k: v for k, v in stats.items() if not k.startswith("per_rank")}
        out.update(model=model.name, train=args.train, infer=args.infer, ranks=per_rank)
        if proj is not None:
            out["projection"] = proj
        print(json.dumps(out, indent=1))
    else:
        print(_plan_text(args, model, train, infer, layout_s, stats, per_rank, proj))
    return 0


def _usage() -> str:
    width = max(map(len, _SUBCOMMANDS))
    lines = [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in _SUBCOMMANDS.items()]
    return "usage: awex-fast COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(lines) + \
        "\n\n`awex-fast COMMAND --help` describes a command's arguments."


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``awex-fast`` script: dispatch ``argv[0]`` to its subcommand."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in _SUBCOMMANDS:
        print(f"awex-fast: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = _SUBCOMMANDS[name]
    run: Callable[[list[str]], int] = getattr(importlib.import_module(module), func)
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
