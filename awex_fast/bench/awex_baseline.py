"""Awex 0.9 as a baseline, on the same metadata and processes as awex_fast.

Used by ``awex-fast bench`` (the ``awex`` method) and benchmarks/bench_plan.py. Awex is an
optional install (``pip install awex==0.9.0 'megatron-core==0.16.*'``, see README); nothing else
in awex_fast imports it.

What runs is Awex's own code path for separated training / inference: its
``TransferPlanBuilder.build_local_transfer_plan`` once, then per update what its NCCL writer and
reader do: ``nccl_build_send_ops`` / ``nccl_build_recv_ops`` (one message per shard overlap,
non-contiguous training slices made contiguous), ``batch_send_recv`` over a torch.distributed
world of the transfer ranks (gloo on CPU), and the copy back of non-contiguous receive slices.
Awex does not cast in separated mode, so its training tensors must already be in the inference
dtype.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from awex_fast.meta import ParameterMeta


def awex_available() -> bool:
    """True when Awex (0.9) can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("awex") is not None
    except (ImportError, ValueError):
        return False


def quiet_awex_logs() -> None:
    """Awex logs every plan and update at INFO; keep its loggers at ERROR."""
    from awex import logging as alog

    alog._default_level = alog.LogLevel.ERROR
    for lg in alog._loggers.values():
        lg.setLevel("ERROR")


def to_awex(metas: Sequence[ParameterMeta], rank_base: int, engine_ranks: int | None = None) -> list:
    """awex_fast metas (rules) -> Awex ParameterMeta with replicas. Inference: engine 0's pieces
    only (``engine_ranks`` = ranks per engine), in engine-local ranks, as Awex expects; training:
    training-local ranks (transfer rank - ``rank_base``)."""
    from awex.meta.weight_meta import ParameterMeta as AwexMeta
    from awex.meta.weight_meta import ParameterReplicaMeta, ParameterShardMeta

    out = []
    for m in metas:
        dtype = getattr(torch, m.dtype)
        replicas = []
        for rule in m.rules:
            total = rule.total_chunks
            for j in range(rule.replicas):
                shards = []
                for c in rule.nonempty_cells(m.global_shape):
                    r = rule.ranks[j * total + c]
                    if engine_ranks is not None and r >= engine_ranks:
                        continue
                    off, shape = rule.cell_box(m.global_shape, c)
                    shards.append(ParameterShardMeta(
                        tp_rank=0, attn_tp_rank=0, pp_rank=0, ep_rank=0, ep_tp_rank=0,
                        global_rank=r - rank_base, world_size=0, engine_rank=0, name=m.name,
                        shape=shape, numel=0, dtype=dtype, global_offset=off,
                    ))  # fmt: skip
                if shards:
                    replicas.append(ParameterReplicaMeta(shards=shards))
        flat = [s for r in replicas for s in r.shards]
        out.append(AwexMeta(name=m.name, global_numel=0, global_shape=m.global_shape, dtype=dtype,
                            shards=flat, replicas=replicas))  # fmt: skip
    return out


def awex_plan(
    train: Sequence[ParameterMeta],
    infer: Sequence[ParameterMeta],
    rank: int,
    n_infer: int,
    n_train: int,
    engines: int,
) -> Any:
    """Awex's TransferPlan for transfer ``rank`` (inference ranks first, training after)."""
    from awex.transfer.transfer_plan import TransferPlanBuilder

    quiet_awex_logs()
    builder = TransferPlanBuilder(
        infer_world_size=n_infer, train_world_size=n_train, num_infer_engines=engines
    )
    quiet_awex_logs()  # the builder's import registered more loggers
    a_train = to_awex(train, n_infer)
    a_infer = to_awex(infer, 0, engine_ranks=n_infer // engines)
    return builder.build_local_transfer_plan(a_infer, a_train, rank)


class AwexSync:
    """One rank's Awex update: ``run()`` sends (training rank) or receives (inference rank) every
    shard overlap of Awex's plan over ``group`` (a torch.distributed group whose ranks are the
    transfer ranks; None: the default world)."""

    def __init__(
        self, plan: Any, tensors: Mapping[str, torch.Tensor], is_train: bool, group: Any = None
    ) -> None:
        self.plan, self.tensors, self.is_train, self.group = plan, dict(tensors), is_train, group
        self.messages = sum(len(v) for v in plan.operations.values())

    def run(self) -> None:
        """One update, exactly as Awex's NCCL writer / reader perform it."""
        from awex.transfer.nccl_comm import batch_send_recv, nccl_build_recv_ops, nccl_build_send_ops

        if self.is_train:
            ops, _, _ = nccl_build_send_ops(self.tensors, self.plan, self.group, -1, True)
            batch_send_recv(send_ops=ops, recv_ops=[], blocking=True, use_group=True)
            return
        ops, non_contiguous, _ = nccl_build_recv_ops(self.tensors, self.plan, self.group, True)
        batch_send_recv(send_ops=[], recv_ops=ops, blocking=True, use_group=True)
        for original, staged in non_contiguous:  # Awex's reader: _sync_non_contiguous_tensor_pairs
            original.copy_(staged)
