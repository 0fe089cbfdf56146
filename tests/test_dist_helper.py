"""tests/_dist.run_world itself: results come back in rank order, a failing worker's traceback
reaches the caller, and a hung world is killed with every worker's stack. No torch import here,
so each world starts in well under a second."""

from __future__ import annotations

import time

import pytest
from _dist import WorldError, WorldTimeout, run_world


def _echo_or_raise(rank, world, text):
    if text == "raise" and rank == 1:
        raise RuntimeError(f"boom on {rank}")
    return {"rank": rank, "world": world, "text": text}


def _sleep(rank, world):
    time.sleep(300)


def test_results_in_rank_order():
    out = run_world(_echo_or_raise, 3, "hi", backend=None, timeout=60)
    assert out == [{"rank": r, "world": 3, "text": "hi"} for r in range(3)]


def test_worker_traceback_reaches_the_caller():
    with pytest.raises(WorldError, match=r"(?s)rank 1 of 2 failed.*RuntimeError: boom on 1"):
        run_world(_echo_or_raise, 2, "raise", backend=None, timeout=60)


def test_hung_world_is_killed_with_stacks():
    start = time.monotonic()
    with pytest.raises(WorldTimeout, match=r"(?s)exceeded 3 s.*in _sleep"):
        run_world(_sleep, 2, backend=None, timeout=3)
    assert time.monotonic() - start < 30
