"""One rank of `awex-fast bench` (see awex_fast/bench/run.py):
``python -m awex_fast.bench.worker SPEC``.

Transfer ranks: inference first (``0 .. n_infer-1``), training after. Layouts are rules over
the canonical names and shapes of awex_fast.layouts.models. Training: FSDP2-style dim-0 chunks of each
parameter (of its TP shard when tp > 1: colwise on dim 0, rowwise on dim 1). Inference: TP per
engine (colwise dim 0, rowwise dim 1, vocab-parallel embeddings, replicated norms), replicated
across engines. Training weights are ``torch.randn`` with a seed per (parameter, piece), negated
between iterations (exact, so the oracle can recompute them); inference ranks recompute them at
the end and compare bit-exactly after the cast.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from awex_fast.meta import ParameterMeta, ShardRule
from awex_fast.plan import build_plan
from awex_fast.transfer import Executor
from awex_fast.transfer import boxcopy as afc
from awex_fast.transfer.wire import torch_dtype, wire_buckets
from awex_fast.transport import init_transfer_group_on_free_port


def train_rule(shape: tuple[int, ...], tp_dim: int | None, fsdp: int, tp: int, base: int) -> ShardRule:
    """FSDP2 over the TP shard: mesh (dp, tp), global rank = dp * tp_size + tp."""
    ranks = list(range(base, base + fsdp * tp))
    if tp == 1 or tp_dim is None or len(shape) == 0:
        # TP-replicated params: FSDP chunks over dp, replicated over tp (dp-major ranks).
        order = [base + d * tp + t for t in range(tp) for d in range(fsdp)]
        return ShardRule(tuple(order), (0,) if shape else (), (fsdp,) if shape else (), replicas=tp)
    if tp_dim == 0:  # TP on dim 0, then FSDP chunks of each TP shard: tp-major chunks
        order = [base + (c % fsdp) * tp + c // fsdp for c in range(fsdp * tp)]
        return ShardRule(tuple(order), (0,), (fsdp * tp,))
    return ShardRule(tuple(ranks), (0, 1), (fsdp, tp))  # rowwise: dp on dim 0, tp on dim 1


def infer_rule(shape: tuple[int, ...], tp_dim: int | None, tp: int, engines: int) -> ShardRule:
    """TP inside each engine, replicated across engines (engine-major transfer ranks)."""
    ranks = tuple(range(tp * engines))
    if tp == 1 or tp_dim is None or not shape:
        return ShardRule(ranks, (), (), replicas=tp * engines)
    return ShardRule(ranks, (tp_dim,), (tp,), replicas=engines)


def layouts(spec: dict) -> tuple[list[ParameterMeta], list[ParameterMeta]]:
    """Training and inference metas (transfer ranks) of the bench's model and layouts."""
    from awex_fast.layouts import model_spec

    n_infer = spec["n_infer"]
    train, infer = [], []
    for ts in model_spec(spec["model"], spec["layers"]).tensors:
        t = train_rule(ts.shape, ts.tp_dim, spec["train"]["fsdp"], spec["train"]["tp"], n_infer)
        i = infer_rule(ts.shape, ts.tp_dim, spec["infer"]["tp"], spec["infer"]["engines"])
        train.append(ParameterMeta(ts.name, ts.shape, spec["train_dtype"], rules=(t,)))
        infer.append(ParameterMeta(ts.name, ts.shape, spec["dtype"], rules=(i,)))
    return train, infer


def piece_values(name: str, offset: tuple[int, ...], shape: tuple[int, ...], iteration: int) -> torch.Tensor:
    """The float32 training values of one piece at ``iteration`` (the oracle recomputes them)."""
    seed = (hash_name(name) * 1_000_003 + sum((k + 1) * o for k, o in enumerate(offset))) % (2**62)
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return t.neg_() if iteration % 2 else t


def hash_name(name: str) -> int:
    """A stable (process-independent) integer for a name."""
    h = 1469598103934665603
    for ch in name.encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 64)
    return h


def _box(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


class Barrier:
    """All ranks of the bench meet on the parent's store before each timed step."""

    def __init__(self, store: dist.Store, world: int) -> None:
        self.store, self.world, self.n = store, world, 0

    def __call__(self) -> None:
        self.n += 1
        key = f"barrier{self.n}"
        self.store.add(key, 1)
        while self.store.add(key, 0) < self.world:
            time.sleep(0.0005)


def _raw(
    group: object,
    rp: object,
    dev: torch.device,
    cast_from: torch.dtype | None = None,
    to: torch.dtype | None = None,
) -> tuple[callable, int, callable]:
    """Each (sender, receiver) pair sends one contiguous buffer of the bytes it carries. With
    ``cast_from`` (the ``raw_cast`` method) each sender first casts that buffer from the training
    dtype in one contiguous native copy: the bound for any method that must cast.

    Returns (run, bytes received, refresh); ``refresh`` rewrites what ``run`` reads first (the
    send buffers, or the cast's sources), as the bench rewrites the training weights before every
    awex_fast sync, so that a bound never reads memory left in cache by its previous iteration
    while awex_fast reads freshly written weights (a server's L3, 480 MB here, holds much of a
    sender's buffer)."""
    pair_bytes: dict[tuple[str, int], int] = {}
    for role, buckets in (("send", rp.sends), ("recv", rp.recvs)):
        for b in buckets:
            pair_bytes[(role, b.peer)] = pair_bytes.get((role, b.peer), 0) + b.payload
    # Send buffers hold real bytes: untouched memory would map the kernel's shared zero page, which
    # every read finds in cache, and make this bound faster than any real weights could go.
    bufs = {
        (role, peer): torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
        if role == "send"
        else torch.empty(n, dtype=torch.uint8, device=dev)
        for (role, peer), n in pair_bytes.items()
    }
    sends = [buf for (role, _), buf in bufs.items() if role == "send"]
    sources, casts, rewrite = sends, [], torch.Tensor.bitwise_not_
    if cast_from is not None:
        wires = [buf[: buf.numel() // to.itemsize * to.itemsize].view(to) for buf in sends]
        sources = [torch.randn(w.numel(), device=dev).to(cast_from) for w in wires]
        casts = [afc.direct_program([s], [w], streaming=False) for s, w in zip(sources, wires, strict=True)]
        rewrite = torch.Tensor.neg_

    def refresh() -> None:
        for t in sources:
            rewrite(t)

    def run() -> None:
        for program in casts:
            program.run()
        pending = [
            (group.isend if role == "send" else group.irecv)(buf, peer, 0)
            for (role, peer), buf in bufs.items()
        ]
        for p in pending:
            p.wait(group.timeout_s)

    return run, sum(n for (role, _), n in pair_bytes.items() if role == "recv"), refresh


def _naive(
    group: object, rank: int, spec: dict, train: list, infer: list, tensors: dict, dev: torch.device
) -> tuple[callable, int]:
    """Gather every full parameter on training rank 0 and send it to every inference rank, one
    parameter at a time (each distinct training box comes from its lowest-ranked holder)."""
    n_infer = spec["n_infer"]
    root = n_infer
    inf_dtype = torch_dtype(spec["dtype"])
    biggest = max(math.prod(m.global_shape) for m in train)
    full_buf = (
        torch.empty(biggest, dtype=torch_dtype(spec["train_dtype"]), device=dev) if rank == root else None
    )
    cast_buf = torch.empty(biggest, dtype=inf_dtype, device=dev) if rank == root or rank < n_infer else None
    # what this inference rank receives (every full parameter once); the bench sums over ranks
    nbytes = sum(math.prod(m.global_shape) for m in infer) * inf_dtype.itemsize
    steps = []
    for t_meta, i_meta in zip(train, infer, strict=True):
        holders: dict[tuple, object] = {}
        for p in sorted(t_meta.pieces(), key=lambda p: (p.rank != root, p.rank)):
            holders.setdefault((p.global_offset, p.shape), p)
        mine = [p for p in i_meta.pieces() if p.rank == rank]
        steps.append((t_meta, math.prod(t_meta.global_shape), list(holders.values()), mine))

    def run() -> None:
        wait = group.timeout_s
        for t_meta, numel, holders, mine in steps:
            if rank >= n_infer and rank != root:  # training ranks hand their shard to the root
                if any(p.rank == rank for p in holders):
                    group.isend(tensors[t_meta.name], root, 0).wait(wait)
            elif rank == root:
                full = full_buf[:numel].view(t_meta.global_shape)
                for p in holders:
                    box = _box(p.global_offset, p.shape)
                    if p.rank == root:
                        full[box].copy_(tensors[t_meta.name])
                    else:
                        part = torch.empty(p.shape, dtype=full.dtype, device=dev)
                        group.irecv(part, p.rank, 0).wait(wait)
                        full[box].copy_(part)
                out = cast_buf[:numel]
                out.copy_(full.reshape(-1))
                for w in [group.isend(out, r, 1) for r in range(n_infer)]:
                    w.wait(wait)
            elif rank < n_infer:  # inference rank: keep its own pieces of the full tensor
                got = cast_buf[:numel]
                group.irecv(got, root, 1).wait(wait)
                full = got.view(t_meta.global_shape)
                for p in mine:
                    tensors[t_meta.name][_box(p.local, p.shape)].copy_(full[_box(p.global_offset, p.shape)])

    return run, nbytes


def _awex(
    parent: dist.Store, rank: int, spec: dict, train: list, infer: list, tensors: dict, nbytes: int
) -> tuple[callable, int]:
    """Awex 0.9's plan and execution over a default gloo world of the same processes. Awex cannot
    cast, so its training side sends copies of the training weights in the inference dtype
    (made here, untimed), or the training tensors themselves when they already are in it."""
    from awex_fast.bench.awex_baseline import AwexSync, awex_plan

    world, n_infer = spec["world"], spec["n_infer"]
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("awex_world/", parent),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=spec["timeout"]),
    )
    plan = awex_plan(train, infer, rank, n_infer, world - n_infer, spec["infer"]["engines"])
    is_train = rank >= n_infer
    dtype = torch_dtype(spec["dtype"])
    mine = {n: t.to(dtype) for n, t in tensors.items()} if is_train else tensors
    return AwexSync(plan, mine, is_train).run, nbytes


def _device(spec: dict, rank: int) -> torch.device:
    """CPU for gloo and ipc; else one GPU per rank, round robin over the node's devices."""
    if spec["backend"] in ("gloo", "ipc"):
        return torch.device("cpu")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _local_tensors(spec: dict, train: list, infer: list, rank: int,
                   dev: torch.device) -> dict[str, torch.Tensor]:
    """This rank's pieces: known values on a training rank, zeros on an inference rank."""
    is_train = rank >= spec["n_infer"]
    tensors: dict[str, torch.Tensor] = {}
    for m in train if is_train else infer:
        for p in m.pieces():
            if p.rank == rank:
                if is_train:
                    values = piece_values(m.name, p.global_offset, p.shape, 0)
                    tensors[m.name] = values.to(dev, torch_dtype(spec["train_dtype"]))
                else:
                    tensors[m.name] = torch.zeros(p.shape, dtype=torch_dtype(spec["dtype"]), device=dev)
    return tensors


def _join_group(parent: dist.Store, spec: dict, rank: int) -> Any:
    """The transfer group: transfer rank 0 binds a free port for its store and publishes it."""

    def await_port() -> int:
        parent.wait(["group_port"])
        return int(parent.get("group_port"))

    group, _ = init_transfer_group_on_free_port(
        spec["backend"], rank, spec["world"], "127.0.0.1", lambda port: parent.set("group_port", str(port)),
        await_port, spec["timeout"])
    return group


def _runners(spec: dict, parent: dist.Store, rank: int, ex: Executor, rp: Any, group: Any, train: list,
             infer: list, tensors: dict[str, torch.Tensor], dev: torch.device) -> dict[str, tuple]:
    """method -> (sync, bytes it moves, what runs untimed before each iteration, or None)."""
    is_train = rank >= spec["n_infer"]
    version = [0]

    def sync() -> None:
        version[0] += 1
        ex.run(version[0])

    def new_weights() -> None:
        for t in tensors.values():
            t.neg_()  # new weights every sync, same storage

    runners = {"awex_fast": (sync, rp.recv_bytes, new_weights if is_train else None)}
    if "raw" in spec["methods"]:
        runners["raw"] = _raw(group, rp, dev)
    if "raw_cast" in spec["methods"]:
        cast_from, to = torch_dtype(spec["train_dtype"]), torch_dtype(spec["dtype"])
        runners["raw_cast"] = _raw(group, rp, dev, cast_from, to)
    if "naive" in spec["methods"]:
        runners["naive"] = (*_naive(group, rank, spec, train, infer, tensors, dev), None)
    if "awex" in spec["methods"]:
        runners["awex"] = (*_awex(parent, rank, spec, train, infer, tensors, rp.recv_bytes), None)
    return runners


def _timed_rounds(spec: dict, runners: dict[str, tuple], barrier: Barrier) -> tuple[dict, dict]:
    """Wall and CPU seconds of every method, interleaved: iteration ``i`` runs the methods rotated
    by ``i`` (A B C, B C A, ...), so load that comes and goes on the host falls on all of them and
    each iteration's ratios compare neighbours. Iteration 0 is the warm-up and is not kept."""
    methods = list(spec["methods"])
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    for it in range(spec["iters"] + 1):
        k = it % len(methods)
        for method in methods[k:] + methods[:k]:
            fn, _, before = runners[method]
            if before is not None:
                before()
            barrier()
            t1, c1 = time.perf_counter(), time.process_time()
            fn()
            if it > 0:
                times[method].append(time.perf_counter() - t1)
                cpu[method].append(time.process_time() - c1)  # every thread of this process
    return times, cpu


def _profile_rounds(spec: dict, runners: dict[str, tuple], barrier: Barrier) -> dict[str, dict]:
    """One more, untimed, round of awex_fast and of each raw bound under cProfile: seconds per
    category (`awex_fast.bench.profile`) and the functions with the most own time."""
    from awex_fast.bench.profile import profile_call, top_functions

    out = {}
    for method in [m for m in ("awex_fast", "raw", "raw_cast") if m in spec["methods"]]:
        fn, _, before = runners[method]
        if before is not None:
            before()
        barrier()
        out[method] = profile_call(fn)
        if before is not None:
            before()
        barrier()
        out[method]["top"] = top_functions(fn, 8)
    return out


def _verify_rounds(spec: dict, runners: dict[str, tuple], barrier: Barrier, train: list, infer: list,
                   rank: int, tensors: dict[str, torch.Tensor]) -> bool:
    """One more, untimed, round of each method that writes the inference weights, each checked on
    the inference ranks before the next one overwrites them."""
    is_train = rank >= spec["n_infer"]
    # the training weights are negated before every awex_fast round, this one included
    profiled = 2 if spec.get("profile") else 0  # the two profiled awex_fast rounds
    syncs = spec["iters"] + 2 + profiled if "awex_fast" in spec["methods"] else 0
    # Awex is handed the training weights in the inference dtype: the live tensors themselves when
    # no cast is needed (`Tensor.to` returns its own tensor), else copies made at iteration 0.
    awex = syncs if spec["train_dtype"] == spec["dtype"] else 0
    expected = {"awex_fast": syncs, "naive": syncs, "awex": awex}
    verified = True
    for method in [m for m in ("awex_fast", "naive", "awex") if m in spec["methods"]]:
        fn, _, before = runners[method]
        if before is not None:
            before()
        barrier()
        fn()
        barrier()
        if not is_train:
            verified = verify(train, infer, rank, tensors, expected[method]) and verified
    return verified


def main(spec_path: str) -> int:
    """Run one rank of the bench and write its result JSON."""
    spec = json.loads(Path(spec_path).read_text())
    rank, world, n_infer = spec["rank"], spec["world"], spec["n_infer"]
    parent = dist.TCPStore("127.0.0.1", spec["port"], is_master=False,
                           timeout=datetime.timedelta(seconds=spec["timeout"]))
    barrier = Barrier(parent, world)
    if spec.get("copy_threads"):
        afc.set_num_threads(spec["copy_threads"])
    train, infer = layouts(spec)
    t0 = time.perf_counter()
    plan = build_plan(train, infer, bucket_bytes=spec["bucket_mb"] << 20)
    rp = plan.for_rank(rank)
    plan_s = time.perf_counter() - t0
    dev = _device(spec, rank)
    tensors = _local_tensors(spec, train, infer, rank, dev)
    group = _join_group(parent, spec, rank)
    ex = Executor(wire_buckets(rp), tensors, group, digest=plan.digest(), verify=spec["verify"],
                  **{k: spec[k] for k in ("message_bytes", "solo_bytes") if spec.get(k)})
    ex.handshake()
    runners = _runners(spec, parent, rank, ex, rp, group, train, infer, tensors, dev)
    times, cpu = _timed_rounds(spec, runners, barrier)
    profile = _profile_rounds(spec, runners, barrier) if spec.get("profile") else {}
    verified = _verify_rounds(spec, runners, barrier, train, infer, rank, tensors)
    barrier()
    group.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    result = {
        "rank": rank, "times": times, "cpu": cpu,
        "bytes": {m: _global_bytes(parent, m, runners[m][1], rank, n_infer, world) for m in spec["methods"]},
        "verified": verified, "plan": plan.stats() if rank == 0 else {}, "plan_rank_s": plan_s,
        "staging_bytes": ex.staging_bytes, "trace": [vars(t) for t in ex.trace] if spec["trace"] else [],
        "profile": profile,
    }
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


def _global_bytes(store: dist.Store, method: str, mine: int, rank: int, n_infer: int, world: int) -> int:
    """Bytes received by all inference ranks for one method (summed through the store)."""
    if rank < n_infer:
        store.add(f"bytes/{method}", int(mine))
    store.add(f"bytes_done/{method}", 1)
    while store.add(f"bytes_done/{method}", 0) < world:
        time.sleep(0.001)
    return int(store.add(f"bytes/{method}", 0))


def verify(train: list, infer: list, rank: int, tensors: dict, iteration: int) -> bool:
    """Recompute the training pieces, assemble each parameter, compare this rank's pieces."""
    for t_meta, i_meta in zip(train, infer, strict=True):
        mine = [p for p in i_meta.pieces() if p.rank == rank]
        if not mine:
            continue
        full = torch.empty(t_meta.global_shape, dtype=torch_dtype(t_meta.dtype))  # training dtype
        for p in t_meta.pieces():
            full[_box(p.global_offset, p.shape)] = piece_values(
                t_meta.name, p.global_offset, p.shape, iteration
            )
        local = tensors[i_meta.name]
        for p in mine:
            want = full[_box(p.global_offset, p.shape)].to(local.dtype)
            if not torch.equal(local[_box(p.local, p.shape)].cpu(), want):
                print(f"rank {rank}: {i_meta.name} differs at {p.global_offset}", file=sys.stderr)
                return False
    return True


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
