"""runtime.training.data: synthetic tokens are a learnable function of (seed, step), the same rows for every
dp slicing."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.training.data import FOLLOW, SyntheticTokens


@settings(max_examples=25, deadline=None)
@given(
    vocab=st.integers(2, 300),
    seq=st.integers(1, 40),
    batch=st.sampled_from([2, 4, 8]),
    dp=st.sampled_from([1, 2]),
    step=st.integers(0, 10**6),
    seed=st.integers(0, 2**40),
)
def test_every_dp_slice_sees_the_rows_of_the_whole_batch(vocab, seq, batch, dp, step, seed):
    data = SyntheticTokens(vocab, seq, seed)
    ids, labels = data.rows(step, 0, batch, batch)
    assert ids.shape == labels.shape == (batch, seq) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < vocab
    assert torch.equal(ids[:, 1:], labels[:, :-1])  # labels are the inputs shifted by one
    per = batch // dp
    for d in range(dp):
        part = SyntheticTokens(vocab, seq, seed).rows(step, d * per, (d + 1) * per, batch)
        assert torch.equal(part[0], ids[d * per : (d + 1) * per]) and torch.equal(
            part[1], labels[d * per : (d + 1) * per]
        )


def test_tokens_follow_their_successor_so_a_model_can_learn_them():
    vocab = 1000
    data = SyntheticTokens(vocab, 256, seed=3)
    ids, labels = data.rows(0, 0, 64, 64)
    succ = torch.from_numpy(data.successor)
    follow = (labels == succ[ids]).float().mean().item()
    # FOLLOW of the transitions take the successor, plus the uniform draws that hit it by chance.
    assert math.isclose(follow, FOLLOW + (1 - FOLLOW) / vocab, abs_tol=0.01)
    assert sorted(data.successor.tolist()) == list(range(vocab))  # a permutation: every token has one
    other = SyntheticTokens(vocab, 256, seed=4)
    assert not torch.equal(other.rows(0, 0, 64, 64)[0], ids) and not (other.successor == data.successor).all()
    assert torch.equal(SyntheticTokens(vocab, 256, seed=3).rows(0, 0, 64, 64)[0], ids)  # (seed, step) fixes it
