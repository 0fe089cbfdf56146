"""Block-FP8 checkpoints the way FP8 releases are made (DeepSeek-V3 / Qwen3-FP8 style), for the
vLLM bench and the tests: every decoder linear weight through vLLM's own quantizer
(``vllm.utils.deep_gemm.per_block_cast_to_fp8``, blocks 128 x 128: ``weight`` in e4m3,
``weight_scale_inv`` in float32, one scale per block), everything else in bfloat16, and the
config's ``quantization_config`` saying so. vLLM's quantizer is used, not awex_fast's, because vLLM
is the authority on the format it serves (and the tests' oracle)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["FP8_BLOCK", "FP8_LINEARS", "fp8_checkpoint", "fp8_config", "misaligned_for_tp"]

FP8_BLOCK = (128, 128)
FP8_LINEARS = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
               ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")


def fp8_config(config: Mapping) -> dict:
    """``config`` (a Hugging Face config dict) with block-FP8 ``quantization_config``."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    out["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(FP8_BLOCK)}
    return out


def fp8_checkpoint(state: Mapping[str, torch.Tensor], config_dir: str | os.PathLike[str],
                   out: str | os.PathLike[str], dequantized: str | os.PathLike[str] | None = None) -> str:
    """Write ``state`` (any float dtype) as a block-FP8 checkpoint in ``out`` (module docstring),
    with the config of ``config_dir``. ``dequantized``: also write the bfloat16 checkpoint of what
    the FP8 model computes with (each weight times its block scale). Returns ``out``."""
    from safetensors.torch import save_file
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    fp8: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(FP8_LINEARS):
            q, s = per_block_cast_to_fp8(t, block_size=list(FP8_BLOCK), use_ue8m0=False)
            fp8[name], fp8[name + "_scale_inv"] = q.contiguous(), s.float().contiguous()
            if dequantized is not None:
                n, k = q.shape
                scale = s.float().repeat_interleave(FP8_BLOCK[0], 0)[:n].repeat_interleave(FP8_BLOCK[1], 1)
                plain[name] = (q.float() * scale[:, :k]).to(torch.bfloat16)
        else:
            fp8[name] = t.to(torch.bfloat16).contiguous()
            if dequantized is not None:
                plain[name] = fp8[name]
    config = json.loads((Path(config_dir) / "config.json").read_text())
    targets = [(out, fp8, fp8_config(config))]
    if dequantized is not None:
        targets.append((dequantized, plain, {k: v for k, v in config.items() if k != "quantization_config"}))
    for target, tensors, cfg in targets:
        Path(target).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(Path(target) / "model.safetensors"), metadata={"format": "pt"})
        (Path(target) / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out)


def misaligned_for_tp(shapes: Mapping[str, tuple[int, ...]], tp: int) -> list[str]:
    """The FP8 linears of ``shapes`` whose TP-``tp`` shard vLLM cannot serve block-quantized (it
    requires each rank's output rows of a column-parallel layer, and input columns of a
    row-parallel one, to be whole 128-blocks); each entry names the tensor and the cut."""
    bad = []
    for name, shape in shapes.items():
        if not name.endswith(FP8_LINEARS):
            continue
        rows, cols = shape
        row_parallel = name.endswith((".o_proj.weight", ".down_proj.weight"))
        dim, size = ("input columns", cols) if row_parallel else ("output rows", rows)
        if size % tp or (size // tp) % FP8_BLOCK[0]:
            bad.append(f"{name}: {size} {dim} / TP{tp} = {size / tp:g}, not a multiple of {FP8_BLOCK[0]}")
    return bad
