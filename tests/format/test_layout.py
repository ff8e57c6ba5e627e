"""Shard planning (lmprobe.format.layout): pure arithmetic, checked against a row-by-row reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from lmprobe.format.layout import Cursor, plan


def reference(cursor: Cursor, counts: list[int], cap: int):
    """Place prompts one by one: a prompt that does not fit in a non-empty shard opens the next one."""
    shard, rows, prompts = cursor.shard, cursor.rows, cursor.prompts
    shard_of, offset_of, closes = [], [], []
    batch_row = 0
    for c in counts:
        if c == 0:
            shard_of.append(-1)
            offset_of.append(0)
            continue
        if rows > 0 and rows + c > cap:
            closes.append(batch_row)
            shard, rows, prompts = shard + 1, 0, 0
        shard_of.append(shard)
        offset_of.append(rows)
        rows += c
        prompts += 1
        batch_row += c
    return shard_of, offset_of, closes, Cursor(shard, rows, prompts)


def check(cursor: Cursor, counts: list[int], cap: int) -> None:
    p = plan(cursor, counts, cap)
    shard_of, offset_of, closes, after = reference(cursor, counts, cap)
    assert p.shard_of.tolist() == shard_of
    assert p.offset_of.tolist() == offset_of
    assert p.after == after
    # segments tile the batch's rows, close shards exactly where the reference does, and count prompts
    total = int(np.sum(counts))
    assert [s.row_lo for s in p.segments if s.close_before] == closes
    if total:
        assert p.segments[0].row_lo == 0 and p.segments[-1].row_hi == total
        assert all(a.row_hi == b.row_lo for a, b in zip(p.segments, p.segments[1:], strict=False))
        assert all(s.close_before for s in p.segments[1:])
    assert sum(s.prompts for s in p.segments) == sum(1 for c in counts if c)


def test_the_docstring_example():
    p = plan(Cursor(0, 0, 0), [2, 2, 2], cap_rows=4)
    assert p.shard_of.tolist() == [0, 0, 1] and p.offset_of.tolist() == [0, 2, 0]
    assert p.after == Cursor(1, 2, 1)


@pytest.mark.parametrize("rows", range(0, 13))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9])
def test_one_row_each_at_every_fill_level(rows, n):
    # rows past the cap (4) happen after a prompt larger than the budget filled a shard alone
    check(Cursor(2, rows, min(rows, 1) if rows > 4 else rows), [1] * n, cap=4)


def test_after_an_oversized_prompt_the_next_one_row_batch_opens_a_new_shard():
    p = plan(Cursor(0, 3, 1), [1], cap_rows=1)
    assert p.shard_of.tolist() == [1] and p.offset_of.tolist() == [0]
    assert p.segments[0].close_before and p.after == Cursor(1, 1, 1)


@given(shard=st.integers(0, 5), rows=st.integers(0, 40), cap=st.integers(1, 13),
       counts=st.lists(st.integers(0, 20), max_size=40))
@example(shard=0, rows=3, cap=1, counts=[1])  # the oversized-prompt crash of the first writer
@example(shard=0, rows=16, cap=4, counts=[1, 1, 1])
@example(shard=0, rows=0, cap=1, counts=[0, 0, 1])
def test_plan_matches_the_reference(shard, rows, cap, counts):
    check(Cursor(shard, rows, 1 if rows else 0), counts, cap)


def test_negative_counts_and_caps_are_refused():
    with pytest.raises(ValueError):
        plan(Cursor(0, 0, 0), [1, -1], 4)
    with pytest.raises(ValueError):
        plan(Cursor(0, 0, 0), [1], 0)


def test_writer_survives_a_one_token_prompt_after_an_oversized_one(tmp_path):
    """The reproduction from the architecture issue: it crashed with 'negative dimensions are not allowed'."""
    import lmprobe
    from lmprobe.format import DatasetWriter

    with DatasetWriter(tmp_path / "ds", layers=[0], dim=4, model_name="m", storage="full_sequence",
                       shard_size=16) as w:
        w.add_batch(texts=["a"], num_tokens=[3], hidden={0: np.zeros((3, 4), np.float32)})
        w.add_batch(texts=["b"], num_tokens=[2], hidden={0: np.ones((2, 4), np.float32)})
    ds = lmprobe.load(tmp_path / "ds")
    np.testing.assert_array_equal(ds.token_hidden(1, 0), np.ones((2, 4), np.float32))
    assert lmprobe.validate(tmp_path / "ds").ok
