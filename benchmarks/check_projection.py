"""Check `awex-fast plan --link-gbps` against runs on this machine (issue 23, part 3).

Reads the JSON of one or more ``awex-fast bench ... --methods awex_fast,raw --json FILE`` runs,
derives each run's per-rank transport rate from its ``raw`` method (every pair of the plan sends
its bytes as one buffer, all pairs at once, so the busiest rank's bytes over raw's median is the
rate the transport gave one rank), feeds that rate to `awex_fast.cli.projected_sync` with the
run's own plan stats, and compares the projection with the measured ``awex_fast`` median. Exits 1
when a run is off by more than ``--tolerance`` (default 25 %).

Caveat printed with the table: on one machine every "link" shares the same cores and memory
bandwidth, so a rate measured by ``raw`` is the rate of that exact traffic pattern; the check
then says how close awex_fast gets to its transport, not how well a network model predicts.

    awex-fast bench --model qwen2.5-0.5b --train fsdp=2 --infer tp=1,engines=2 \
        --methods awex_fast,raw --iters 3 --backend ipc --json /tmp/ipc.json
    python benchmarks/check_projection.py /tmp/ipc.json
"""

from __future__ import annotations

import argparse
import json
import sys

from awex_fast.cli import projected_sync


def check(run: dict) -> dict:
    """Projection vs measurement for one bench JSON (its ``plan`` stats and ``methods``)."""
    stats, methods = run["plan"], run["methods"]
    busiest = max(stats["send_bytes_max"], stats["recv_bytes_max"])
    raw_s = methods["raw"]["median_s"]
    gbps = busiest / raw_s * 8 / 1e9
    proj = projected_sync(stats, gbps)
    measured = methods["awex_fast"]["median_s"]
    return {"backend": run["layout"]["backend"], "rank_gbps": gbps, "projected_s": proj["projected_s"],
            "bound_s": proj["bound_s"], "measured_s": measured,
            "error": (measured - proj["projected_s"]) / measured}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Print one row per bench JSON; exit 1 if any is off by more than the tolerance."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("files", nargs="+", help="awex-fast bench --json outputs (with raw and awex_fast)")
    parser.add_argument("--tolerance", type=float, default=0.25)
    args = parser.parse_args(argv)
    bad = 0
    head = f"{'rank Gbit/s':>11} {'projected s':>11} {'measured s':>10} {'error':>7}"
    print(f"{'file':32} {'backend':8} {head}")
    for path in args.files:
        with open(path) as f:
            row = check(json.load(f))
        bad += abs(row["error"]) > args.tolerance
        print(f"{path[-32:]:32} {row['backend']:8} {row['rank_gbps']:11.2f} {row['projected_s']:11.3f} "
              f"{row['measured_s']:10.3f} {row['error']:+7.1%}")  # fmt: skip
    print("(one machine: every link shares the same cores and memory, see the module docstring)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
