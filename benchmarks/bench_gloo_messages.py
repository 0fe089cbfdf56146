"""Does gloo charge per message? Each of 2 senders sends each of 2 receivers (4 processes on
127.0.0.1, the bench's default layout) the same bytes as 1 message or as N messages posted at
once, and every rank reports its wall time and its user / kernel CPU per round (medians).

    python benchmarks/bench_gloo_messages.py [--mb-per-pair 247] [--messages 1,90] [--rounds 7]

Used to tell whether the executor's many messages per pair explain its extra kernel time over
gloo (README, "Where the CPU goes"): they do. On the 2-core machine, 90 messages per pair cost
the senders 121-130 ms of kernel time against 84-99 ms for 1 message, and the round took
240-267 ms against 206-226 ms (``--messages 90,1,90,1``, 2026-12-05).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from awex_fast.net import free_port


def _rank(rank: int, port: int, per_pair: int, messages: int, rounds: int) -> dict:
    """One rank: ranks 0-1 receive, 2-3 send; returns medians over ``rounds`` (after a warm-up)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=120))
    size = per_pair // messages
    peers = [2, 3] if rank < 2 else [0, 1]
    bufs = {p: torch.randint(0, 256, (size * messages,), dtype=torch.uint8) for p in peers}
    wall, user, kernel = [], [], []
    for it in range(rounds + 1):
        if rank >= 2:
            for b in bufs.values():
                b.bitwise_not_()  # fresh bytes every round, as the bench rewrites its weights
        dist.barrier()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        post = dist.isend if rank >= 2 else dist.irecv
        works = [post(bufs[p][i * size:(i + 1) * size], p, tag=i) for i in range(messages) for p in peers]
        for w in works:
            w.wait()
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        if it:
            wall.append(t1 - t0)
            user.append(r1.ru_utime - r0.ru_utime)
            kernel.append(r1.ru_stime - r0.ru_stime)
    dist.destroy_process_group()
    return {"rank": rank, "messages": messages, "wall_ms": 1e3 * statistics.median(wall),
            "user_ms": 1e3 * statistics.median(user), "kernel_ms": 1e3 * statistics.median(kernel)}


def main() -> None:
    """Run every message count as its own 4-process world and print one line per rank."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb-per-pair", type=int, default=247)
    p.add_argument("--messages", default="1,90")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:  # a child: one rank of one world
        out = _rank(args.rank, args.port, args.mb_per_pair << 20, int(args.messages), args.rounds)
        print(json.dumps(out), flush=True)
        return
    for n in (int(x) for x in args.messages.split(",")):
        port = free_port()
        cmd = [sys.executable, __file__, "--mb-per-pair", str(args.mb_per_pair), "--messages", str(n),
               "--rounds", str(args.rounds), "--port", str(port)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
                 for r in range(4)]
        for proc in procs:
            row = json.loads(proc.communicate(timeout=600)[0].strip().splitlines()[-1])
            role = "receiver" if row["rank"] < 2 else "sender"
            print(f"{n:4d} messages/pair  rank {row['rank']} ({role}): wall {row['wall_ms']:.0f} ms  "
                  f"user {row['user_ms']:.0f} ms  kernel {row['kernel_ms']:.0f} ms")


if __name__ == "__main__":
    main()
