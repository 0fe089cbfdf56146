"""pytest-benchmark form of bench_copy.py (never part of CI: testpaths is tests/).

    pytest benchmarks/test_bench_copy.py --benchmark-only
"""

from __future__ import annotations

import pytest
import torch
from bench_copy import make_case

from awex_fast.transfer import boxcopy as afc

CASES = ["a_4x64MiB", "b_4096x64KiB", "c_8192sq_8colblocks"]


@pytest.fixture(scope="module", params=CASES)
def case(request):
    views, nbytes = make_case(request.param, "cpu")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    offsets, acc = [], 0
    for v in views:
        offsets.append(acc)
        acc += v.numel() * v.element_size()
    return request.param, views, buf, offsets, nbytes


def test_contiguous_copy_baseline(benchmark, case):
    _, _, _, _, nbytes = case
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    benchmark(dst.copy_, src)


def test_pack_program(benchmark, case):
    _, views, buf, offsets, _ = case
    benchmark(afc.gather_program(views, buf, offsets, torch.float32).run)


def test_unpack_program(benchmark, case):
    _, views, buf, offsets, _ = case
    benchmark(afc.scatter_program(buf, offsets, torch.float32, views).run)
