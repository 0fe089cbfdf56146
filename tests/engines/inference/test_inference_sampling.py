"""Batched per-request sampling: greedy, temperature, top-k, top-p, min_new_tokens, logprobs."""

from __future__ import annotations

import pytest
import torch

from python_engines.inference.sampling import SamplingParams, sample


def logits_rows(n: int, vocab: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_and_logprob_of_the_unfiltered_distribution():
    logits = logits_rows(3)
    params = [SamplingParams(greedy=True), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.5, top_k=1)]
    tokens, logprobs = sample(logits, params, [0, 0, 0])
    assert tokens.tolist() == logits.argmax(-1).tolist()
    # temperature 1 for greedy rows; log_softmax(logits / T) before top-k for the sampled one
    expect = [torch.log_softmax(logits[0], -1), torch.log_softmax(logits[1], -1),
              torch.log_softmax(logits[2] / 0.5, -1)]
    for b in range(3):
        assert logprobs[b].item() == pytest.approx(expect[b][tokens[b]].item(), abs=1e-6)


def test_temperature_sampling_follows_softmax():
    """20k draws of one row at T=0.7: every token's frequency is within 5 standard errors of
    softmax(logits / 0.7) (binomial standard error sqrt(p(1-p)/n))."""
    n = 20000
    row = logits_rows(1, vocab=6, seed=1)
    logits = row.expand(n, 6).contiguous()
    tokens, _ = sample(logits, [SamplingParams(temperature=0.7)] * n, [0] * n,
                       torch.Generator().manual_seed(2))
    freq = torch.bincount(tokens, minlength=6).double() / n
    p = torch.softmax(row[0].double() / 0.7, -1)
    assert torch.all((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-9), (freq, p)


def test_top_k_and_top_p_restrict_the_support():
    n = 4000
    row = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, -2.0]])
    logits = row.expand(n, 6).contiguous()
    gen = torch.Generator().manual_seed(3)
    tokens, _ = sample(logits, [SamplingParams(top_k=2)] * n, [0] * n, gen)
    assert set(tokens.tolist()) == {0, 1}
    probs = torch.softmax(row[0], -1)
    # top_p just above the top-2 mass keeps exactly 3 tokens (the third starts below top_p)
    top_p = float(probs[:2].sum()) + 1e-3
    tokens, _ = sample(logits, [SamplingParams(top_p=top_p)] * n, [0] * n, gen)
    assert set(tokens.tolist()) == {0, 1, 2}
    tokens, _ = sample(logits, [SamplingParams(top_p=1e-6)] * n, [0] * n, gen)
    assert set(tokens.tolist()) == {0}  # the top token is always kept


def test_min_new_tokens_blocks_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 9.0, 1.0], [0.0, 9.0, 1.0]])
    params = SamplingParams(greedy=True, stop_token_ids=[1], min_new_tokens=2, max_new_tokens=4)
    tokens, logprobs = sample(logits, [params, params], [1, 2])
    assert tokens.tolist() == [2, 1]  # row 0 has 1 < 2 tokens: stop token 1 is masked
    assert logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())


def test_mixed_rows_and_parameter_errors():
    logits = logits_rows(4)
    params = [SamplingParams(greedy=True), SamplingParams(temperature=1.3, top_k=3),
              SamplingParams(greedy=True), SamplingParams(top_p=0.5)]
    tokens, _ = sample(logits, params, [0] * 4, torch.Generator().manual_seed(0))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert tokens[1].item() in logits[1].topk(3).indices.tolist()
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="unknown sampling_params field"):
        SamplingParams.from_json({"temprature": 1.0})
    with pytest.raises(ValueError, match="2 params"):
        sample(logits, params[:2], [0] * 4)
