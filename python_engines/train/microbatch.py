"""Micro-batching of padded batches by a token budget (first-fit-decreasing).

A batch is a ``TensorDict`` holding ``input_ids`` and ``attention_mask`` of shape ``[B, S]``
(padded on either side) plus any other per-row (``[B, ...]``) or per-token (``[B, S, ...]``)
entries. A micro-batch is a subset of rows, trimmed to the columns where at least one of its rows
has a real token, so its cost, the number of token slots the model actually computes, is
``rows * longest row``. `ffd_groups` packs rows into as few micro-batches as fit
``max_tokens_per_mb`` (a row longer than the budget gets a micro-batch of its own), then splits
the largest groups until there are at least ``min_groups``.

Every data-parallel rank must run the same number of micro-batches (each forward all-gathers
FSDP parameters), so the engine agrees on the maximum count across ranks and tops a short rank up
with *filler* micro-batches (`with_fillers`): a real row whose output is discarded and whose loss
is multiplied by zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict

__all__ = [
    "MicroBatch",
    "ffd_groups",
    "group_cost",
    "pad_and_stack",
    "select_rows",
    "sequence_lengths",
    "split_batch",
    "with_fillers",
]


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``indices`` of the original batch, trimmed; ``filler`` ones only keep ranks in step."""

    data: TensorDict
    indices: tuple[int, ...]
    filler: bool = False

    @property
    def num_tokens(self) -> int:
        """Token slots this micro-batch computes (rows x trimmed length)."""
        mask = self.data["attention_mask"]
        return int(mask.shape[0] * mask.shape[1])


def sequence_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens per row of a ``[B, S]`` mask; raises ValueError naming an empty row."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be [B, S], got shape {tuple(attention_mask.shape)}")
    lengths = attention_mask.ne(0).sum(dim=1).tolist()
    for row, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"row {row} of the batch has no tokens (attention_mask is all zero)")
    return [int(n) for n in lengths]


def group_cost(lengths: Sequence[int], group: Sequence[int]) -> int:
    """Padded token slots of ``group``: rows x longest row."""
    if not group:
        return 0
    return len(group) * max(lengths[i] for i in group)


def ffd_groups(lengths: Sequence[int], max_tokens: int | None, min_groups: int = 1) -> list[list[int]]:
    """Partition row indices into micro-batches by first-fit-decreasing on padded cost.

    Rows are taken longest first and put into the first group whose cost stays within
    ``max_tokens`` (None: no budget, one group). Then, while fewer than ``min_groups`` groups
    exist, the costliest group with two or more rows is split in two (rows alternately), which
    never raises a group's cost. Returns groups of ascending indices; fewer than ``min_groups``
    only when there are fewer rows than that.
    """
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens_per_mb must be positive, got {max_tokens}")
    if min_groups < 1:
        raise ValueError(f"min_groups must be >= 1, got {min_groups}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        for group in groups:
            # Rows arrive longest first, so the group's longest row is its first one.
            if max_tokens is None or (len(group) + 1) * lengths[group[0]] <= max_tokens:
                group.append(i)
                break
        else:
            groups.append([i])
    while len(groups) < min_groups:
        splittable = [g for g in groups if len(g) >= 2]
        if not splittable:
            break
        victim = max(splittable, key=lambda g: group_cost(lengths, g))
        groups.remove(victim)
        groups.extend([victim[0::2], victim[1::2]])
    return [sorted(g) for g in groups]


def select_rows(batch: TensorDict, rows: Sequence[int]) -> TensorDict:
    """Rows ``rows`` of ``batch``, with per-token entries trimmed to the rows' real columns.

    An entry is per-token when its second dimension equals the batch's sequence length ``S``
    (``[B, S, ...]``); other entries are only row-indexed.
    """
    mask = batch["attention_mask"]
    seq_len = mask.shape[1]
    index = torch.as_tensor(list(rows), dtype=torch.long, device=mask.device)
    cols = mask.index_select(0, index).ne(0).any(dim=0).nonzero().squeeze(1)
    if batch.batch_dims >= 2 and batch.batch_size[1] == seq_len:
        return batch[index][:, cols]
    out: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"batch entry {key!r} is a {type(value).__name__}; micro-batching needs tensors")
        picked = value.index_select(0, index.to(value.device))
        if picked.ndim >= 2 and picked.shape[1] == seq_len:
            picked = picked.index_select(1, cols.to(value.device))
        out[key] = picked
    return TensorDict(out, batch_size=[len(rows)], device=batch.device)


def split_batch(batch: TensorDict, max_tokens_per_mb: int | None, min_groups: int = 1) -> list[MicroBatch]:
    """`ffd_groups` of ``batch`` as `MicroBatch` objects (no fillers)."""
    for key in ("input_ids", "attention_mask"):
        if key not in batch.keys():  # noqa: SIM118 (TensorDict has no __contains__)
            raise KeyError(f"batch has no {key!r} entry (keys: {sorted(batch.keys())})")
    if batch["input_ids"].shape != batch["attention_mask"].shape:
        raise ValueError(
            f"input_ids {tuple(batch['input_ids'].shape)} and attention_mask "
            f"{tuple(batch['attention_mask'].shape)} must have the same [B, S] shape"
        )
    lengths = sequence_lengths(batch["attention_mask"])
    groups = ffd_groups(lengths, max_tokens_per_mb, min_groups)
    return [MicroBatch(select_rows(batch, g), tuple(g)) for g in groups]


def with_fillers(mbs: list[MicroBatch], batch: TensorDict, count: int) -> list[MicroBatch]:
    """``mbs`` followed by filler micro-batches (the batch's shortest row) up to ``count``."""
    if len(mbs) >= count:
        return list(mbs)
    lengths = sequence_lengths(batch["attention_mask"])
    shortest = min(range(len(lengths)), key=lambda i: lengths[i])
    filler = MicroBatch(select_rows(batch, [shortest]), (shortest,), filler=True)
    return list(mbs) + [filler] * (count - len(mbs))


def pad_and_stack(pieces: Sequence[torch.Tensor], pad_value: float = 0.0) -> torch.Tensor:
    """Stack ``[len_i, ...]`` tensors into ``[N, max len_i, ...]``, right-padded with ``pad_value``."""
    if not pieces:
        raise ValueError("pad_and_stack needs at least one tensor")
    width = max(p.shape[0] for p in pieces)
    tail = pieces[0].shape[1:]
    out = pieces[0].new_full((len(pieces), width, *tail), pad_value)
    for i, piece in enumerate(pieces):
        if piece.shape[1:] != tail:
            raise ValueError(
                f"output {i} has trailing shape {tuple(piece.shape[1:])}, expected {tuple(tail)}"
            )
        out[i, : piece.shape[0]] = piece
    return out
