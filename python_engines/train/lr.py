"""Learning-rate schedules: constant, linear and cosine, each after a linear warmup.

The factors follow Hugging Face ``transformers.get_*_schedule_with_warmup`` (which AReaL's engines
use), so runs ported from there see the same learning rates: warmup rises linearly from 0 at
step 0 to 1 at ``warmup_steps``; linear and cosine then decay to ``min_lr_ratio`` at
``total_steps`` (``min_lr_ratio=0`` reproduces HF exactly). One difference: past ``total_steps``
cosine stays at its floor instead of rising again as HF's formula does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

LR_SCHEDULER_TYPES = ("constant", "linear", "cosine")


def warmup_steps_from_proportion(total_steps: int, proportion: float) -> int:
    """Warmup length as AReaL sizes it: ``int(proportion * total_steps)``."""
    if not 0.0 <= proportion <= 1.0:
        raise ValueError(f"warmup_steps_proportion must be in [0, 1], got {proportion}")
    return int(proportion * total_steps)


def lr_factor(kind: str, step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if kind not in LR_SCHEDULER_TYPES:
        raise ValueError(f"lr_scheduler_type must be one of {LR_SCHEDULER_TYPES}, got {kind!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if kind == "constant":
        return 1.0
    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    progress = min(max(progress, 0.0), 1.0)
    decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    kind: str,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """A ``LambdaLR`` over `lr_factor`; call ``.step()`` once per optimizer step."""
    if kind != "constant" and total_steps <= 0:
        raise ValueError(f"a {kind!r} schedule needs total_steps > 0, got {total_steps}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    lr_factor(kind, 0, total_steps, warmup_steps, min_lr_ratio)  # validates kind and ratio

    def factor(step: int) -> float:
        return lr_factor(kind, step, total_steps, warmup_steps, min_lr_ratio)

    fn: Callable[[int], float] = factor
    return LambdaLR(optimizer, fn)
