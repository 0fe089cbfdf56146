"""The supervised loss the training tests step with (train_batch's ``loss_fn`` / ``loss_weight_fn``)."""

from __future__ import annotations

import torch


def next_token_loss(logits: torch.Tensor, mb: dict) -> torch.Tensor:
    """Mean next-token cross entropy over the micro-batch's real next-token positions."""
    ids, mask = mb["input_ids"], mb["attention_mask"]
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    ce = torch.nn.functional.cross_entropy(flat, ids[:, 1:].reshape(-1), reduction="none")
    m = mask[:, 1:].reshape(-1).float()
    return (ce * m).sum() / m.sum().clamp(min=1.0)


def loss_tokens(mb: dict) -> float:
    """Number of loss tokens: weighting by it makes the step the global token-mean loss."""
    return float(mb["attention_mask"][:, 1:].sum())
