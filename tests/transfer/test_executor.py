"""The executor end to end over real gloo transfer groups, checked bit-exactly against global
tensors built independently in every process (the oracle) and sliced per rank."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from _dist import run_world
from _jobs import free_port

from awex_fast.meta import ParameterMeta, ShardRule
from awex_fast.plan import build_plan
from awex_fast.transfer.executor import Executor, PlanMismatchError, metadata_fingerprints, wire_buckets
from awex_fast.transport import TransferError, init_transfer_group

# name -> (global shape, inference split dim or None for replicated)
PARAMS = {
    "embed.weight": ((64, 24), 0),
    "layer.q.weight": ((48, 24), 0),
    "layer.o.weight": ((24, 48), 1),
    "layer.norm.weight": ((24,), None),
    "layer.bias": ((7,), 0),
    # an MoE layer's stacked experts: the training side splits experts over its ranks (EP), the
    # inference side splits every expert's rows (TP inside each expert)
    "moe.experts.w13": ((8, 16, 12), 1),
}


def global_tensor(name: str, version: int) -> torch.Tensor:
    """The oracle: every process builds the same global tensor for (name, version)."""
    shape, _ = PARAMS[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)) * 1000 + version)
    return torch.randn(shape, generator=gen)


def layout(n_infer: int, n_train: int, train_dtype: str, infer_dtype: str, tp: int):
    """Training: dim-0 chunks over n_train ranks; inference: engines of tp ranks (replicated
    across engines), split on the TP dim or replicated."""
    train, infer = [], []
    engines = n_infer // tp
    for name, (shape, dim) in PARAMS.items():
        train.append(
            ParameterMeta(
                name,
                shape,
                train_dtype,
                rules=(ShardRule(tuple(range(n_infer, n_infer + n_train)), (0,), (n_train,)),),
            )
        )
        if dim is None:
            rule = ShardRule(tuple(range(n_infer)), (), (), replicas=n_infer)
        else:
            rule = ShardRule(tuple(range(n_infer)), (dim,), (tp,), replicas=engines)
        infer.append(ParameterMeta(name, shape, infer_dtype, rules=(rule,)))
    return train, infer


def local_tensors(metas, rank: int, dtype: torch.dtype, version: int | None):
    """This rank's local tensors (its pieces of the oracle, or zeros when version is None)."""
    out = {}
    for m in metas:
        for p in m.pieces():
            if p.rank == rank:
                if version is None:
                    out[m.name] = torch.zeros(p.shape, dtype=dtype)
                else:
                    index = tuple(slice(o, o + s) for o, s in zip(p.global_offset, p.shape, strict=True))
                    out[m.name] = global_tensor(m.name, version)[index].to(dtype).contiguous()
    return out


def check_pieces(metas, rank: int, tensors, version: int) -> list[str]:
    bad = []
    for m in metas:
        for p in m.pieces():
            if p.rank == rank:
                index = tuple(slice(o, o + s) for o, s in zip(p.global_offset, p.shape, strict=True))
                want = global_tensor(m.name, version)[index].to(tensors[m.name].dtype)
                if not torch.equal(tensors[m.name], want):
                    bad.append(m.name)
    return bad


def _sync_worker(
    rank, world_size, port, n_infer, tp, bucket_bytes, updates, verify, cut=None, backend="gloo"
):
    n_train = world_size - n_infer
    train, infer = layout(n_infer, n_train, "float32", "bfloat16", tp)
    plan = build_plan(train, infer, bucket_bytes=bucket_bytes)
    is_train = rank >= n_infer
    tensors = local_tensors(
        train if is_train else infer,
        rank,
        torch.float32 if is_train else torch.bfloat16,
        0 if is_train else None,
    )
    group = init_transfer_group(backend, rank, world_size, "127.0.0.1", port, timeout=60)
    ex = Executor(
        wire_buckets(plan.for_rank(rank)),
        tensors,
        group,
        digest=plan.digest(),
        verify=verify,
        **(cut or {}),
    )
    ex.handshake()
    pointers = ex.staging_pointers()
    bad, traces = [], []
    for version in range(updates):
        if is_train and version > 0:  # new training weights, same storage
            for name, t in local_tensors(train, rank, torch.float32, version).items():
                tensors[name].copy_(t)
        ex.run(version)
        if not is_train:
            bad += [f"v{version}:{n}" for n in check_pieces(infer, rank, tensors, version)]
        traces.append([vars(t) for t in ex.trace])
        assert ex.staging_pointers() == pointers, "staging buffers were reallocated"
    group.close()
    return {
        "bad": bad,
        "version": ex.version,
        "trace": traces[-1],
        "staging": ex.staging_bytes,
        "zero_copy": ex.zero_copy_fraction(),
    }


def test_fsdp_chunks_to_two_tp2_engines_cast_bit_exact_over_ten_updates():
    out = run_world(_sync_worker, 6, free_port(), 4, 2, 1 << 20, 10, False, backend=None, timeout=240)
    assert all(o["bad"] == [] for o in out), [o["bad"] for o in out]
    assert [o["version"] for o in out] == [9] * 6


def test_ipc_fsdp_chunks_to_two_tp2_engines_cast_bit_exact_over_ten_updates():
    # Shared slots: every message is packed into the receiver's slot and unpacked from it.
    out = run_world(
        _sync_worker, 6, free_port(), 4, 2, 1 << 20, 10, False, None, "ipc", backend=None, timeout=240
    )
    assert all(o["bad"] == [] for o in out), [o["bad"] for o in out]
    assert [o["version"] for o in out] == [9] * 6
    assert all(o["zero_copy"] == 0.0 for o in out)
    assert all(o["staging"] > 0 for o in out[:4]) and all(o["staging"] == 0 for o in out[4:])


def test_ipc_many_small_messages_reuse_slots_across_updates_with_checksums():
    # 96-byte messages: many per pair, so slots are reused within an update and the chunk
    # numbering carries over three updates; checksums cover every message.
    cut = {"message_bytes": 96}
    out = run_world(
        _sync_worker, 5, free_port(), 3, 1, 1 << 20, 3, True, cut, "ipc", backend=None, timeout=240
    )
    assert all(o["bad"] == [] for o in out), [o["bad"] for o in out]
    assert max(t["nbytes"] for o in out for t in o["trace"]) <= 96
    assert min(len(o["trace"]) for o in out) > 8


def test_many_buckets_overlap_pack_with_transfer_and_verify_checksums():
    # 256-byte buckets: every peer gets several buckets, so bucket k+1 must be packed while
    # bucket k is still on the wire.
    out = run_world(_sync_worker, 3, free_port(), 1, 1, 256, 2, True, backend=None, timeout=180)
    assert all(o["bad"] == [] for o in out)
    overlapped = 0
    for o in out[1:]:
        mine = sorted((t for t in o["trace"] if t["role"] == "send"), key=lambda t: t["seq"])
        assert len(mine) >= 3
        for a, b in itertools.pairwise(mine):
            overlapped += b["pack_start"] < a["transfer_end"]
    assert overlapped >= 2


def test_zero_copy_and_chunked_messages_with_checksums_bit_exact():
    # Tiny message limits: ops of >= 64 bytes travel alone in chunks of <= 96 bytes, so the same
    # message is zero-copy on one side and staged on the other (bf16 receivers are contiguous;
    # f32 senders must cast) while small ops share staged messages; checksums cover both kinds.
    cut = {"message_bytes": 96, "solo_bytes": 64}
    out = run_world(_sync_worker, 5, free_port(), 3, 1, 1 << 20, 3, True, cut, backend=None, timeout=240)
    assert all(o["bad"] == [] for o in out), [o["bad"] for o in out]
    receivers, senders = out[:3], out[3:]
    assert all(o["zero_copy"] > 0.5 for o in receivers), [o["zero_copy"] for o in receivers]
    assert all(o["zero_copy"] == 0.0 for o in senders)  # f32 -> bf16 always packs
    assert max(t["nbytes"] for o in out for t in o["trace"]) <= 96


def _moved_storage_worker(rank, world_size, port):
    # Receiver tensors are re-allocated between updates, 2-D ones as transposed (non-contiguous)
    # storage: messages that went zero-copy must now be staged, and staging must grow for them.
    train, infer = layout(1, 1, "float32", "bfloat16", 1)
    plan = build_plan(train, infer, bucket_bytes=1 << 20)
    is_train = rank == 1
    dtype = torch.float32 if is_train else torch.bfloat16
    tensors = local_tensors(train if is_train else infer, rank, dtype, 0 if is_train else None)
    group = init_transfer_group("gloo", rank, world_size, "127.0.0.1", port, timeout=60)
    cut = {"message_bytes": 96, "solo_bytes": 64}
    ex = Executor(wire_buckets(plan.for_rank(rank)), tensors, group, digest=plan.digest(), **cut)
    ex.handshake()
    ex.run(0)
    before = ex.zero_copy_fraction()
    bad = []
    if is_train:
        for name, t in local_tensors(train, rank, torch.float32, 1).items():
            tensors[name].copy_(t)
    else:
        bad += check_pieces(infer, rank, tensors, 0)
        for t in tensors.values():
            if t.dim() == 2:
                t.data = torch.zeros(t.shape[::-1], dtype=t.dtype).t()
    ex.run(1)
    if not is_train:
        bad += [f"v1:{n}" for n in check_pieces(infer, rank, tensors, 1)]
    group.close()
    return {"bad": bad, "before": before, "after": ex.zero_copy_fraction()}


def test_moved_storage_rebuilds_programs_and_staging_bit_exact():
    out = run_world(_moved_storage_worker, 2, free_port(), backend=None, timeout=120)
    assert all(o["bad"] == [] for o in out), [o["bad"] for o in out]
    receiver = out[0]
    assert receiver["after"] < receiver["before"], receiver  # zero-copy messages became staged


def _mismatch_worker(rank, world_size, port):
    train, infer = layout(1, 1, "float32", "bfloat16", 1)
    if rank == 1:  # the training side believes in a different dtype for one parameter
        train = [
            m
            if m.name != "layer.norm.weight"
            else ParameterMeta(m.name, m.global_shape, "float16", rules=m.rules)
            for m in train
        ]
    plan = build_plan(train, infer, bucket_bytes=1 << 20)
    tensors = local_tensors(
        train if rank == 1 else infer, rank, torch.float32 if rank else torch.bfloat16, 0 if rank else None
    )
    group = init_transfer_group("gloo", rank, world_size, "127.0.0.1", port, timeout=30)
    ex = Executor(
        wire_buckets(plan.for_rank(rank)),
        tensors,
        group,
        digest=plan.digest(),
        fingerprints=lambda: metadata_fingerprints([("train", train), ("infer", infer)]),
    )
    try:
        ex.handshake()
    except PlanMismatchError as exc:
        return {"error": str(exc)}
    return {"error": None}


def test_mismatched_metadata_refused_on_both_sides_naming_the_parameter():
    out = run_world(_mismatch_worker, 2, free_port(), backend=None, timeout=120)
    for o in out:
        assert o["error"] is not None and "layer.norm.weight" in o["error"], o


def _one_to_one(rank, world_size, port, group_timeout, exec_timeout=None, backend="gloo"):
    """Rank 0 infers and rank 1 trains (one small bucketed layout): the metas, this rank's
    tensors and an executor over a fresh transfer group on ``port``."""
    train, infer = layout(1, 1, "float32", "bfloat16", 1)
    plan = build_plan(train, infer, bucket_bytes=512)
    is_train = rank == 1
    tensors = local_tensors(
        train if is_train else infer,
        rank,
        torch.float32 if is_train else torch.bfloat16,
        0 if is_train else None,
    )
    group = init_transfer_group(backend, rank, world_size, "127.0.0.1", port, timeout=group_timeout)
    ex = Executor(
        wire_buckets(plan.for_rank(rank)), tensors, group, digest=plan.digest(), timeout_s=exec_timeout
    )
    return train, infer, plan, tensors, ex


def _fault_worker(rank, world_size, port, timeout_s, second_port, backend):
    train, infer, plan, tensors, ex = _one_to_one(rank, world_size, port, timeout_s, timeout_s, backend)
    is_train = rank == 1
    ex.handshake()
    ex.run(0)
    if is_train:
        time.sleep(3 * timeout_s)  # the sender stalls: the receiver must give up in time
        result = {"role": "train"}
    else:
        t0 = time.monotonic()
        try:
            ex.run(1)
            result = {"error": None}
        except TransferError as exc:
            result = {
                "error": str(exc),
                "elapsed": time.monotonic() - t0,
                "version": ex.version,
                "peer": exc.peer,
                "bucket": exc.bucket,
            }
    # recovery: a fresh group on a new port, the next update is bit-exact
    group2 = init_transfer_group(backend, rank, world_size, "127.0.0.1", second_port, timeout=30)
    ex2 = Executor(wire_buckets(plan.for_rank(rank)), tensors, group2, digest=plan.digest())
    ex2.handshake()
    if is_train:
        for name, t in local_tensors(train, rank, torch.float32, 2).items():
            tensors[name].copy_(t)
    ex2.run(2)
    if not is_train:
        result["bad_after_recovery"] = check_pieces(infer, rank, tensors, 2)
        result["version_after"] = ex2.version
    group2.close()
    return result


@pytest.mark.parametrize("transfer_backend", ["gloo", "ipc"])
def test_stalled_sender_times_out_then_a_fresh_group_recovers(transfer_backend):
    timeout_s = 2.0
    out = run_world(
        _fault_worker, 2, free_port(), timeout_s, free_port(), transfer_backend, backend=None, timeout=120
    )
    recv = out[0]
    assert recv["error"] is not None and "peer=1" in recv["error"] and "version=1" in recv["error"]
    assert recv["elapsed"] <= 2 * timeout_s + 1.0
    assert recv["version"] == 0  # unchanged by the failed update
    assert recv["bad_after_recovery"] == [] and recv["version_after"] == 2


VANISH_TIMEOUT = 8.0  # generous: a closed connection is usually seen at once, a loaded CI box may lag


def _vanishing_peer_worker(rank, world_size, port, vanishing_rank, backend):
    _, _, _, _, ex = _one_to_one(rank, world_size, port, 10, VANISH_TIMEOUT, backend)
    if rank == vanishing_rank:
        ex.handshake()
        return {}  # the process ends mid-protocol: its connections close under its peer
    t0 = time.monotonic()
    try:  # the handshake may already see it (ipc maps the peer's channel there), or the update
        ex.handshake()
        ex.run(1)
    except TransferError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - t0, "version": ex.version}
    return {"error": None}


@pytest.mark.parametrize("transfer_backend", ["gloo", "ipc"])
def test_sender_that_vanishes_is_reported_within_twice_the_timeout(transfer_backend):
    out = run_world(_vanishing_peer_worker, 2, free_port(), 1, transfer_backend, backend=None, timeout=60)
    assert out[0]["error"] is not None and "peer=1" in out[0]["error"]
    assert out[0]["elapsed"] <= 2 * VANISH_TIMEOUT and out[0]["version"] is None


@pytest.mark.parametrize("transfer_backend", ["gloo", "ipc"])
def test_receiver_that_vanishes_makes_the_sender_raise(transfer_backend):
    out = run_world(_vanishing_peer_worker, 2, free_port(), 0, transfer_backend, backend=None, timeout=60)
    assert out[1]["error"] is not None and "peer=0" in out[1]["error"]
    assert out[1]["elapsed"] <= 2 * VANISH_TIMEOUT
