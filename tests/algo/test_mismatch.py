"""The train/inference logprob mismatch metric."""

from __future__ import annotations

import pytest
import torch

from tandem.algo import batch_logprob_mismatch, logprob_mismatch, set_prox_logprobs
from tandem.train import SequenceBatch


def test_mismatch_all_and_current_version():
    # |recomputed - behave| on loss tokens: 0.1, 0, 0.5 (the 4th token has mask 0: ignored)
    # -> mean 0.2, max 0.5. Current version 3: tokens 0 and 2 -> 0.1, 0.5: mean 0.3, max 0.5.
    out = logprob_mismatch(
        torch.tensor([-1.0, -2.0, -3.0, -0.5]),
        torch.tensor([-1.1, -2.0, -2.5, -9.0]),
        torch.tensor([1, 1, 1, 0]),
        torch.tensor([3, 2, 3, 3]),
        current_version=3,
    )
    assert out["mismatch/mean"] == pytest.approx(0.2) and out["mismatch/max"] == pytest.approx(0.5)
    assert out["mismatch/n_tokens"] == 3
    assert out["mismatch/current_mean"] == pytest.approx(0.3) and out["mismatch/current_max"] == pytest.approx(0.5)
    assert out["mismatch/current_n_tokens"] == 2
    # No token of the current version: the scope is empty, reported as 0 with count 0.
    out = logprob_mismatch([torch.tensor([-1.0])], [torch.tensor([-1.5])], [torch.tensor([1])], [torch.tensor([2])], 3)
    assert out["mismatch/current_n_tokens"] == 0 and out["mismatch/current_mean"] == 0.0
    assert out["mismatch/mean"] == pytest.approx(0.5)


def test_batch_mismatch_after_set_prox_logprobs():
    # forward_logprobs gives next-token alignment: out[t] = logp(token t+1), last 0.
    # set_prox_logprobs shifts it to input alignment: [0, out[0], out[1]].
    batch = SequenceBatch.from_token_lists(
        [[1, 2, 3]], loss_mask=[[0, 1, 1]], logprobs=[[0.0, -1.0, -2.25]], versions=[[-1, 0, 0]]
    )
    set_prox_logprobs(batch, [torch.tensor([-1.0, -2.0, 0.0])])
    assert batch.seqs[0]["prox_logprobs"].tolist() == [0.0, -1.0, -2.0]
    out = batch_logprob_mismatch(batch, current_version=0)
    # diffs 0 and 0.25 -> mean 0.125, max 0.25, both tokens of the current version.
    assert out["mismatch/mean"] == pytest.approx(0.125) and out["mismatch/max"] == pytest.approx(0.25)
    assert out["mismatch/current_n_tokens"] == 2
