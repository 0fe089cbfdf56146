"""Parallelising a Hugging Face decoder: device mesh, tensor parallel, FSDP2, gradient norm.

One ``apply_*`` per parallelism, applied in order (torchtitan's ``parallelize_llama`` shape):
`apply_tp` turns the Llama/Qwen2-family projections into DTensor column/row-parallel layers on
the ``tp`` mesh dimension, then `apply_fsdp` shards every parameter along dim 0 across the ``dp``
dimension with ``fully_shard`` (each decoder layer is one FSDP unit, the root holds embeddings,
final norm and ``lm_head``). Parameter names stay the Hugging Face names throughout.

TP plan (no sequence parallel, activations between blocks are replicated plain tensors):
q/k/v/gate/up are colwise (output features split, heads split evenly, so attention runs on the
local heads), o/down are rowwise (an all-reduce after each). ``embed_tokens`` is rowwise over
the vocabulary (masked lookup + all-reduce) and ``lm_head`` colwise over the vocabulary with the
logits all-gathered, so the loss sees full ``[n, L, vocab]`` logits. Both place the
``[vocab, hidden]`` weight as ``Shard(0)``, so tied embeddings stay one parameter: it is re-tied
after sharding and lives in the root FSDP unit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

__all__ = [
    "apply_fsdp",
    "apply_tp",
    "build_mesh",
    "clip_grad_norm_",
    "decoder_layer_tp_plan",
    "global_grad_norm",
    "mixed_precision_policy",
]

_LAYER_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def build_mesh(device_type: str, dp_size: int, tp_size: int) -> DeviceMesh:
    """A ``(dp, tp)`` mesh over the whole default process group (tp ranks are adjacent)."""
    world = dist.get_world_size()
    if dp_size * tp_size != world:
        raise ValueError(f"dp_size * tp_size = {dp_size} * {tp_size} must equal the world size {world}")
    return init_device_mesh(device_type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))


def decoder_layer_tp_plan() -> dict[str, ParallelStyle]:
    """Column/row-parallel styles for one Llama/Qwen2-family decoder layer."""
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no model.layers ModuleList; only Llama/Qwen2-family causal LMs "
            "are supported"
        )
    return layers


def _check_tp_divisibility(config: object, tp_size: int) -> None:
    for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, attr, None)
        if value is None:
            raise ValueError(f"model config has no {attr}; cannot plan tensor parallelism")
        if value % tp_size != 0:
            raise ValueError(f"config.{attr} = {value} is not divisible by tp_size = {tp_size}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard ``model``'s decoder projections, embeddings and ``lm_head`` over ``tp_mesh``.

    Requires heads, KV heads, intermediate size and vocabulary divisible by the TP size (raises
    ValueError naming the config field) and the Llama/Qwen2 module names (raises TypeError).
    """
    tp_size = tp_mesh.size()
    _check_tp_divisibility(model.config, tp_size)
    layers = _decoder_layers(model)
    for index, layer in enumerate(layers):
        for name in _LAYER_MODULES:
            try:
                layer.get_submodule(name)
            except AttributeError as exc:
                raise TypeError(f"model.layers.{index} has no {name}; cannot apply the TP plan") from exc
        parallelize_module(layer, tp_mesh, decoder_layer_tp_plan())
    embed = model.get_input_embeddings()
    lm_head = model.get_output_embeddings()
    if not isinstance(embed, nn.Embedding) or not isinstance(lm_head, nn.Linear):
        raise TypeError(
            f"expected nn.Embedding input and nn.Linear output embeddings, got {type(embed).__name__} "
            f"and {type(lm_head).__name__}"
        )
    tied = lm_head.weight is embed.weight
    embed_name = next(n for n, m in model.named_modules() if m is embed)
    head_name = next(n for n, m in model.named_modules() if m is lm_head)
    parallelize_module(
        model,
        tp_mesh,
        {
            embed_name: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            head_name: ColwiseParallel(output_layouts=Replicate()),
        },
    )
    if tied:
        # Both styles place the [vocab, hidden] weight as Shard(0): one DTensor serves both.
        lm_head.weight = embed.weight


def mixed_precision_policy(dtype: str) -> MixedPrecisionPolicy:
    """bf16 compute with float32 master weights and float32 gradient reduction, or all float32."""
    if dtype == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if dtype == "float32":
        return MixedPrecisionPolicy()
    raise ValueError(f"compute dtype must be 'bfloat16' or 'float32', got {dtype!r}")


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool = True
) -> None:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, lm_head)."""
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)


def _replicas(grad: torch.Tensor, world_size: int) -> int:
    """How many ranks of the world hold an identical copy of this rank's local gradient."""
    if not isinstance(grad, DTensor):
        return world_size
    mesh = grad.device_mesh
    replicas = world_size // mesh.size()
    for dim, placement in enumerate(grad.placements):
        if placement.is_replicate():
            replicas *= mesh.size(dim)
        elif placement.is_partial():
            raise ValueError(
                f"gradient with placements {grad.placements} is Partial; reduce it before clipping"
            )
    return replicas


def global_grad_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """The L2 norm of all gradients across every rank, as a float64 scalar on the grads' device.

    Works for any mix of meshes and placements (FSDP-only norms beside FSDP x TP projections):
    each rank sums its local squares per group of equally replicated gradients, divides by the
    replica count, and one all-reduce over the world adds everything up. Never gathers a tensor.
    """
    world_size = dist.get_world_size()
    by_replicas: dict[int, list[torch.Tensor]] = {}
    device: torch.device | None = None
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        device = local.device
        by_replicas.setdefault(_replicas(g, world_size), []).append(local)
    if device is None:
        raise ValueError("no parameter has a gradient; run backward before clipping")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for replicas, grads in by_replicas.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        total = total + norm.double().square() / replicas
    dist.all_reduce(total)
    return total.sqrt()


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    """Scale gradients in place so their global L2 norm is at most ``max_norm`` (0: no clipping).

    Returns the norm before clipping (identical on every rank); a non-finite norm leaves the
    gradients untouched, so the caller can skip the step.
    """
    params = [p for p in parameters if p.grad is not None]
    norm = float(global_grad_norm(params))
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for p in params:
                    g = p.grad
                    (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm
