"""The trainer ranks agreeing among themselves through the default process group: rank 0's JSON
on every rank, and which ranks a condition holds on (so every rank raises together)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

__all__ = ["all_reduce_max", "broadcast_json", "default_group_size", "ranks_where"]


def default_group_size() -> int | None:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def broadcast_json(value: dict, world_size: int) -> dict:
    """Rank 0's ``value`` on every rank, through the default process group (JSON bytes)."""
    if default_group_size() != world_size:
        raise ValueError(f"awex_fast: {world_size} trainer ranks but no default process group of that "
                         "size to share the KV store address; give kv_store_url, admin_api_key and pair "
                         "to every rank")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return json.loads(bytes(buf.cpu().tolist()))


def ranks_where(flag: bool, world_size: int, rank: int) -> list[int]:
    """The trainer ranks where ``flag`` holds (all-reduced over the default group when it spans
    the trainer; otherwise only this rank's own view)."""
    if default_group_size() != world_size or world_size == 1:
        return [rank] if flag else []
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flags = torch.zeros(world_size, dtype=torch.int64, device=device)
    flags[dist.get_rank()] = int(flag)
    dist.all_reduce(flags)
    return [r for r in range(world_size) if int(flags[r])]


def all_reduce_max(tensor: torch.Tensor, world_size: int) -> None:
    """``tensor`` (CPU) becomes its elementwise max over the trainer ranks, in place (through the
    default group, which must span them; nothing to do for one rank)."""
    if world_size == 1:
        return
    if default_group_size() != world_size:
        raise ValueError(f"awex_fast: {world_size} trainer ranks but no default process group of that size "
                         "to agree on FP8 block scales")
    if dist.get_backend() == "nccl":
        on = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on, op=dist.ReduceOp.MAX)
        tensor.copy_(on.cpu())
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
