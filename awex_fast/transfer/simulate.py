"""Run a whole plan in one process through the executor's pack / unpack path.

`simulate` is how the planner is tested end to end without a transport: for every inference
rank and every bucket it receives, the sending training rank packs its bucket (one native batched
copy per receiver dtype, `awex_fast.transfer.boxcopy.pack_at`, casting to the receiver's dtype), the buffer
is "handed over", and the receiver unpacks it into its local tensors (`unpack_at`). Both sides
build their bucket from their own `RankPlan`, so a disagreement between the sender's and the
receiver's view of a bucket is caught here as it would be on the wire.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from awex_fast.plan.planner import Bucket, Plan, PlanError, RankPlan
from awex_fast.transfer import boxcopy as _copy

Tensors = Mapping[int, Mapping[str, torch.Tensor]]


def _views(bucket: Bucket, tensors: Mapping[str, torch.Tensor], rank: int, src: bool) -> dict[str, Any]:
    """Views of one bucket's boxes in ``rank``'s local tensors, grouped by the receiver dtype:
    {dtype name: (views, byte offsets)}."""
    groups: dict[str, tuple[list[torch.Tensor], list[int]]] = defaultdict(lambda: ([], []))
    for op in bucket.ops:
        try:
            local = tensors[op.name]
        except KeyError:
            side = "training" if src else "inference"
            raise ValueError(f"{side} rank {rank} has no local tensor for {op.name!r}") from None
        view = local[op.src_slices() if src else op.dst_slices()]
        if tuple(view.shape) != op.shape:
            box = op.src_offset if src else op.dst_offset
            raise ValueError(
                f"rank {rank}: the box at {box} of shape {op.shape} does not fit the local tensor "
                f"{op.name!r} of shape {tuple(local.shape)}"
            )
        views, offsets = groups[op.dst_dtype]
        views.append(view)
        offsets.append(op.byte_offset)
    return groups


def pack_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], wire: torch.Tensor, rank: int) -> None:
    """Pack a send bucket of ``rank`` from its local ``tensors`` into the uint8 buffer ``wire``
    (``bucket.nbytes`` long): each op at its byte offset, cast to the receiver's dtype."""
    for dtype, (views, offsets) in _views(bucket, tensors, rank, src=True).items():
        _copy.pack_at(views, wire, offsets, getattr(torch, dtype))


def unpack_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], wire: torch.Tensor, rank: int) -> None:
    """Unpack a received bucket from ``wire`` into ``rank``'s local ``tensors``, in place."""
    for dtype, (views, offsets) in _views(bucket, tensors, rank, src=False).items():
        _copy.unpack_at(wire, offsets, getattr(torch, dtype), views)


def _check_same(sent: Bucket, got: Bucket, sender: int, receiver: int) -> None:
    if sent.nbytes != got.nbytes or len(sent.ops) != len(got.ops):
        raise PlanError(
            f"bucket {got.seq} from rank {sender} to rank {receiver}: the sender plans "
            f"{len(sent.ops)} ops / {sent.nbytes} bytes, the receiver {len(got.ops)} / {got.nbytes}"
        )
    for a, b in zip(sent.ops, got.ops, strict=True):
        if (a.name, a.shape, a.byte_offset, a.dst_dtype) != (b.name, b.shape, b.byte_offset, b.dst_dtype):
            raise PlanError(f"bucket {got.seq} from rank {sender} to rank {receiver}: ops differ: {a} vs {b}")


def simulate(plan: Plan, train_tensors: Tensors, infer_tensors: Tensors) -> dict[str, int]:
    """Execute ``plan`` in this process: ``train_tensors`` / ``infer_tensors`` map each transfer
    rank to its local tensors by name (what ``get_local_shard_parameters`` returns); the inference
    tensors are written in place. Returns {"bytes" (payload), "wire_bytes", "buckets", "ops",
    "pairs"}. Raises ValueError for a missing or too small local tensor, PlanError if a sender's
    and a receiver's plan of one bucket disagree."""
    senders: dict[int, tuple[RankPlan, dict[tuple[int, int], Bucket]]] = {}
    stats = {"bytes": 0, "wire_bytes": 0, "buckets": 0, "ops": 0, "pairs": 0}
    bufs: dict[torch.device, torch.Tensor] = {}

    def buffer(tensors: Mapping[str, torch.Tensor], nbytes: int) -> torch.Tensor:
        """A uint8 staging buffer on the device of ``tensors`` (grown, reused)."""
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        buf = bufs.get(device)
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * (0 if buf is None else buf.numel()))
            buf = bufs[device] = torch.empty(size, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    for q in plan.receivers:
        rp = plan.for_rank(q)
        peers = set()
        for bucket in rp.recvs:
            s = bucket.peer
            if s not in senders:
                sp = plan.for_rank(s)
                senders[s] = (sp, {(b.peer, b.seq): b for b in sp.sends})
            sent = senders[s][1].get((q, bucket.seq))
            if sent is None:
                raise PlanError(f"rank {q} expects bucket {bucket.seq} from rank {s}, which does not plan it")
            _check_same(sent, bucket, s, q)
            src, dst = train_tensors.get(s, {}), infer_tensors.get(q, {})
            wire = buffer(src, bucket.nbytes)
            pack_bucket(sent, src, wire, s)
            landed = buffer(dst, bucket.nbytes)
            if landed.device != wire.device:  # "the wire": sender's device -> receiver's
                landed.copy_(wire)
            else:
                landed = wire
            unpack_bucket(bucket, dst, landed, q)
            stats["bytes"] += bucket.payload
            stats["wire_bytes"] += bucket.nbytes
            stats["buckets"] += 1
            stats["ops"] += len(bucket.ops)
            peers.add(s)
        stats["pairs"] += len(peers)
    planned_sends = sum(len(senders[s][0].sends) if s in senders else len(plan.for_rank(s).sends)
                        for s in plan.senders)
    if planned_sends != stats["buckets"]:
        raise PlanError(f"senders plan {planned_sends} buckets but receivers expect {stats['buckets']}")
    return stats


__all__ = ["pack_bucket", "simulate", "unpack_bucket"]
