"""LR schedules against Hugging Face's get_*_schedule_with_warmup (the reference AReaL uses)."""

import math

import pytest
import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from python_engines.train.lr import build_lr_scheduler, lr_factor, warmup_steps_from_proportion


def _lrs(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _optimizer(lr=0.1):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


@pytest.mark.parametrize(
    ("kind", "hf"),
    [
        ("constant", lambda o, w, t: get_constant_schedule_with_warmup(o, w)),
        ("linear", get_linear_schedule_with_warmup),
        ("cosine", get_cosine_schedule_with_warmup),
    ],
)
@pytest.mark.parametrize(("warmup", "total"), [(0, 10), (3, 10), (1, 2), (5, 5)])
def test_matches_hugging_face(kind, hf, warmup, total):
    ours_opt, ref_opt = _optimizer(), _optimizer()
    ours = _lrs(build_lr_scheduler(ours_opt, kind, total, warmup), ours_opt, total)
    ref = _lrs(hf(ref_opt, warmup, total), ref_opt, total)
    assert ours == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_cosine_min_lr_matches_hugging_face():
    ours_opt, ref_opt = _optimizer(), _optimizer()
    ours = _lrs(build_lr_scheduler(ours_opt, "cosine", 12, 2, min_lr_ratio=0.1), ours_opt, 12)
    ref = _lrs(get_cosine_with_min_lr_schedule_with_warmup(ref_opt, 2, 12, min_lr_rate=0.1), ref_opt, 12)
    assert ours == pytest.approx(ref, rel=1e-12)


def test_linear_min_lr_floor_and_past_the_end():
    assert lr_factor("linear", 10, 10, 0, min_lr_ratio=0.2) == pytest.approx(0.2)
    assert lr_factor("linear", 5, 10, 0, min_lr_ratio=0.2) == pytest.approx(0.6)
    # Past the end cosine stays at its floor (HF's formula would rise again).
    assert lr_factor("cosine", 25, 10, 0, min_lr_ratio=0.0) == pytest.approx(0.0, abs=1e-15)
    assert lr_factor("constant", 1000, 10, 0) == 1.0


def test_warmup_from_proportion_and_errors():
    assert warmup_steps_from_proportion(1000, 0.001) == 1
    assert warmup_steps_from_proportion(10, 0.25) == 2
    with pytest.raises(ValueError, match="warmup_steps_proportion"):
        warmup_steps_from_proportion(10, 1.5)
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        lr_factor("step", 0, 10, 0)
    with pytest.raises(ValueError, match="total_steps"):
        build_lr_scheduler(_optimizer(), "cosine", 0, 0)
    assert math.isclose(lr_factor("cosine", 2, 10, 4), 0.5)
