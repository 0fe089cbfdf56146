"""`awex_fast.bench.stall.stall_s`: the stall of one update window from inter-token gaps."""

from __future__ import annotations

import itertools

from awex_fast.bench.stall import stall_s


def _pace(start: float, end: float, step: float) -> list[tuple[float, float]]:
    times = [start + i * step for i in range(round((end - start) / step) + 1)]
    return list(itertools.pairwise(times))


def test_a_stop_for_the_whole_update_scores_its_length_minus_the_normal_pace():
    # tokens every 50 ms, then nothing from 2.0 s to 3.5 s (the update 2.0-3.4 s), then again
    gaps = [*_pace(0.0, 2.0, 0.05), (2.0, 3.5), *_pace(3.5, 5.0, 0.05)]
    got = stall_s(gaps, (2.0, 3.4), [(2.0, 3.4)])
    assert got is not None and abs(got - (1.5 - 0.05)) < 1e-9


def test_an_update_that_never_stops_generation_scores_about_zero():
    gaps = _pace(0.0, 5.0, 0.05)
    got = stall_s(gaps, (2.0, 3.4), [(2.0, 3.4)])
    assert got is not None and abs(got) < 1e-9


def test_the_normal_pace_excludes_every_update_window_and_no_data_is_none():
    gaps = [*_pace(0.0, 1.0, 0.1), (1.0, 2.0), *_pace(2.0, 3.0, 0.1), (3.0, 3.8), *_pace(3.8, 4.8, 0.1)]
    windows = [(1.0, 2.0), (3.0, 3.8)]
    got = stall_s(gaps, windows[1], windows)
    assert got is not None and abs(got - 0.7) < 1e-9  # the 1 s gap of the other update is not "normal"
    assert stall_s([], (0.0, 1.0), [(0.0, 1.0)]) is None
    assert stall_s([(0.0, 1.0)], (0.0, 1.0), [(0.0, 1.0)]) is None  # nothing outside the window
