"""Saving and loading a sharded model: HF safetensors for weights, DCP for optimizer state.

Weights go out as a Hugging Face checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads:
``config.json`` plus ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` shards and
``model.safetensors.index.json`` when larger than ``max_shard_bytes``). Every rank takes part in
gathering each parameter (``DTensor.full_tensor()``), one shard at a time, and rank 0 alone keeps
and writes it, so rank 0 holds at most one shard of full tensors. Tensors are written in the
engine's master dtype (float32), so save -> load round-trips bit-exactly; tied ``lm_head.weight``
is not written (``from_pretrained`` re-ties it).

Loading reads the files on rank 0 only and scatters with
``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``, which understands any
FSDP2 x TP placement. A name or shape mismatch is detected on rank 0 and raised on every rank.

Optimizer and LR-scheduler state use ``torch.distributed.checkpoint`` (each rank writes its own
shards into one directory, which must be on a filesystem all ranks see).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from python_engines.api import ParamSpec

__all__ = [
    "OPTIM_DIR",
    "copy_aux_files",
    "load_hf_into",
    "load_optimizer_state",
    "read_hf_state_dict",
    "save_hf",
    "save_optimizer_state",
    "shard_plan",
]

#: Sub-directory of a save path holding the DCP optimizer / scheduler checkpoint.
OPTIM_DIR = "optim_dcp"
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")


def _dtype_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def shard_plan(specs: list[ParamSpec], max_shard_bytes: int) -> list[list[ParamSpec]]:
    """Split parameters, in order, into consecutive shards of at most ``max_shard_bytes``
    (a parameter larger than that gets a shard of its own)."""
    shards: list[list[ParamSpec]] = []
    current: list[ParamSpec] = []
    size = 0
    for spec in specs:
        nbytes = spec.numel * _dtype_size(spec.dtype)
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _full(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            return tensor.full_tensor()
        return tensor.detach()


def save_hf(
    named_params: Mapping[str, torch.Tensor],
    config: Any,
    path: str | os.PathLike[str],
    max_shard_bytes: int,
    generation_config: Any = None,
) -> list[str]:
    """Write an HF checkpoint of ``named_params`` (canonical name -> DTensor or tensor) to
    ``path``; collective (every rank gathers), rank 0 writes. Returns the weight file names."""
    rank = dist.get_rank()
    directory = Path(path)
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in (_INDEX, _SINGLE):
            (directory / stale).unlink(missing_ok=True)
    specs = [
        ParamSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in named_params.items()
    ]
    shards = shard_plan(specs, max_shard_bytes)
    names = (
        [_SINGLE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard, file_name in zip(shards, names, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for spec in shard:
            full = _full(named_params[spec.name])
            if rank == 0:
                tensors[spec.name] = full.to("cpu").contiguous()
                weight_map[spec.name] = file_name
                total_size += full.numel() * full.element_size()
            del full
        if rank == 0:
            save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
    if rank == 0:
        if len(shards) > 1:
            index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
            (directory / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        saved_config = copy.deepcopy(config)
        saved_config.dtype = specs[0].dtype if specs else "float32"
        saved_config.save_pretrained(str(directory))
        if generation_config is not None:
            generation_config.save_pretrained(str(directory))
    dist.barrier()
    return names


def copy_aux_files(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[str]:
    """Copy tokenizer and other non-weight files of ``src`` missing from ``dst``; returns names."""
    copied: list[str] = []
    for item in sorted(Path(src).iterdir()):
        if not item.is_file() or item.name.endswith(_WEIGHT_SUFFIXES) or item.name in (_INDEX, "config.json"):
            continue
        target = Path(dst) / item.name
        if not target.exists():
            shutil.copy2(item, target)
            copied.append(item.name)
    return copied


def read_hf_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of the HF safetensors checkpoint in ``path`` (single file or indexed shards)."""
    directory = Path(path)
    if (directory / _INDEX).exists():
        files = sorted(set(json.loads((directory / _INDEX).read_text())["weight_map"].values()))
    elif (directory / _SINGLE).exists():
        files = [_SINGLE]
    else:
        raise FileNotFoundError(f"no {_SINGLE} or {_INDEX} in {directory}")
    state: dict[str, torch.Tensor] = {}
    for file_name in files:
        with safe_open(str(directory / file_name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                state[key] = f.get_tensor(key)
    return state


def _check_against(
    state: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor], tied_aliases: Mapping[str, str]
) -> str | None:
    """Why ``state`` cannot load into ``params`` (None when it can); fills tied aliases in place."""
    for alias, target in tied_aliases.items():
        state.pop(alias, None)
        if target not in state:
            return f"checkpoint lacks {target!r} (tied to {alias!r})"
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        return f"parameter names differ: missing {missing[:8]}, unexpected {unexpected[:8]}"
    for name, p in params.items():
        if tuple(state[name].shape) != tuple(p.shape):
            return f"{name}: checkpoint shape {tuple(state[name].shape)} != model shape {tuple(p.shape)}"
    return None


def load_hf_into(
    model: nn.Module,
    named_params: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    tied_aliases: Mapping[str, str],
    device: torch.device,
) -> None:
    """Load the HF checkpoint in ``path`` into the sharded ``model``; collective.

    ``named_params`` are the model's canonical parameters (tied duplicates excluded);
    ``tied_aliases`` maps a tied state-dict key (``lm_head.weight``) to the key it shares.
    Raises ValueError on every rank when names or shapes differ (rank 0 names the parameter).
    """
    rank = dist.get_rank()
    state: dict[str, torch.Tensor] = {}
    problem: str | None = None
    if rank == 0:
        try:
            state = read_hf_state_dict(path)
        except (FileNotFoundError, OSError) as exc:
            problem = f"cannot read {path}: {exc}"
        if problem is None:
            problem = _check_against(state, named_params, tied_aliases)
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    if flag.item():
        raise ValueError(problem if rank == 0 else f"rank 0 could not load the checkpoint in {path}")
    full: dict[str, torch.Tensor] = {}
    if rank == 0:
        for name, p in named_params.items():
            full[name] = state.pop(name).to(device=device, dtype=p.dtype)
        for alias, target in tied_aliases.items():
            full[alias] = full[target]
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    )


def save_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, path: str | os.PathLike[str]
) -> None:
    """Write optimizer (and LR scheduler) state into ``path/optim_dcp`` with DCP; collective."""
    state: dict[str, Any] = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    if scheduler is not None:
        state["lr_scheduler"] = scheduler.state_dict()
    dcp.save(state, checkpoint_id=str(Path(path) / OPTIM_DIR))


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, path: str | os.PathLike[str]
) -> None:
    """Restore what `save_optimizer_state` wrote; collective."""
    directory = Path(path) / OPTIM_DIR
    if not directory.is_dir():
        raise FileNotFoundError(f"no optimizer checkpoint {directory} (was it saved with with_optim=True?)")
    state: dict[str, Any] = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    if scheduler is not None:
        state["lr_scheduler"] = scheduler.state_dict()
    dcp.load(state, checkpoint_id=str(directory))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["lr_scheduler"])
