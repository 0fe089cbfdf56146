"""Shared test helpers (`_dist`, `_jobs`, `_losses`, `vllm_support`, ...) live in this folder; the
tests live in one folder per package (`tests/meta/`, `tests/plan/`, ..., `tests/engines/`), so this
folder goes on ``sys.path`` for all of them."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
