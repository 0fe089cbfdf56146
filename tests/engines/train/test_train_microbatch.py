"""First-fit-decreasing micro-batching of padded batches (pure functions, no processes)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from python_engines.train.microbatch import (
    ffd_groups,
    group_cost,
    pad_and_stack,
    select_rows,
    sequence_lengths,
    split_batch,
    with_fillers,
)


@pytest.mark.parametrize(
    ("lengths", "budget", "min_groups", "expected"),
    [
        ([5, 3, 8, 2], None, 1, [[0, 1, 2, 3]]),
        # 8 alone (2 * 8 > 12); 5 then 3 fit as 2 * 5 = 10; 2 joins them at 3 * 5 = 15 > 12 -> no.
        ([5, 3, 8, 2], 12, 1, [[2], [0, 1], [3]]),
        # Row longer than the budget gets its own micro-batch.
        ([20, 1, 1], 4, 1, [[0], [1, 2]]),
        # Forced to 3 groups without a budget: split the costliest group until 3 exist
        # ([0..3] -> [0, 2] + [1, 3]; the first costliest, [0, 2], splits again).
        ([4, 4, 4, 4], None, 3, [[1, 3], [0], [2]]),
        # Not enough rows for min_groups: as many as there are rows.
        ([3, 2], None, 4, [[0], [1]]),
    ],
)
def test_ffd_table(lengths, budget, min_groups, expected):
    assert ffd_groups(lengths, budget, min_groups) == expected


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    budget=st.one_of(st.none(), st.integers(1, 120)),
    min_groups=st.integers(1, 6),
)
def test_ffd_properties(lengths, budget, min_groups):
    groups = ffd_groups(lengths, budget, min_groups)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))  # every row exactly once
    assert all(g == sorted(g) and g for g in groups)
    assert len(groups) >= min(min_groups, len(lengths))
    if budget is not None:
        for g in groups:
            assert len(g) == 1 or group_cost(lengths, g) <= budget
        # First fit never leaves two groups that could have been one.
        if min_groups == 1:
            for a in range(len(groups)):
                for b in range(a + 1, len(groups)):
                    assert group_cost(lengths, groups[a] + groups[b]) > budget


def _batch(lengths, seq_len=8, left=False):
    b = len(lengths)
    cols = torch.arange(seq_len)[None]
    lens = torch.tensor(lengths)[:, None]
    mask = (cols >= seq_len - lens) if left else (cols < lens)
    ids = torch.arange(b * seq_len).reshape(b, seq_len) * mask
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask.long(),
            "loss_mask": mask.float(),
            "reward": torch.arange(b, dtype=torch.float32),
        },
        batch_size=[b],
    )


@pytest.mark.parametrize("left", [False, True])
def test_select_rows_trims_to_real_columns(left):
    batch = _batch([3, 5, 2, 8], left=left)
    mb = select_rows(batch, [0, 2])
    assert mb["input_ids"].shape == (2, 3)
    assert mb["loss_mask"].shape == (2, 3)
    assert mb["reward"].tolist() == [0.0, 2.0]
    # The real tokens survive the trim unchanged, in order.
    for r, row in enumerate([0, 2]):
        full = batch["input_ids"][row][batch["attention_mask"][row].bool()]
        assert torch.equal(mb["input_ids"][r][mb["attention_mask"][r].bool()], full)


def test_select_rows_with_2d_batch_size():
    batch = _batch([3, 5, 2, 8])
    td = TensorDict({k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}, batch_size=[4, 8])
    mb = select_rows(td, [1, 2])
    assert tuple(mb.batch_size) == (2, 5)
    assert torch.equal(mb["input_ids"], batch["input_ids"][[1, 2], :5])


def test_split_and_fillers():
    batch = _batch([3, 5, 2, 8])
    mbs = split_batch(batch, 10, 1)
    # Longest first: 8 alone; 5 and 3 share (2 * 5 = 10); 2 cannot join (3 * 5 > 10).
    assert [mb.indices for mb in mbs] == [(3,), (0, 1), (2,)]
    assert [mb.num_tokens for mb in mbs] == [8, 10, 2]
    padded = with_fillers(mbs, batch, len(mbs) + 2)
    assert [mb.filler for mb in padded] == [False] * len(mbs) + [True, True]
    assert padded[-1].indices == (2,)  # the shortest row


def test_errors_name_the_problem():
    batch = _batch([3, 0])
    with pytest.raises(ValueError, match="row 1"):
        sequence_lengths(batch["attention_mask"])
    with pytest.raises(KeyError, match="attention_mask"):
        split_batch(TensorDict({"input_ids": torch.zeros(2, 3)}, batch_size=[2]), None)
    with pytest.raises(ValueError, match="max_tokens_per_mb"):
        ffd_groups([1, 2], 0)


def test_pad_and_stack():
    out = pad_and_stack([torch.ones(2, 3), torch.full((4, 3), 2.0)])
    assert out.shape == (2, 4, 3)
    assert torch.equal(out[0, 2:], torch.zeros(2, 3))
    assert torch.equal(out[1], torch.full((4, 3), 2.0))
