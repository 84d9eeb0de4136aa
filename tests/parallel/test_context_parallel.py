"""Ulysses context parallelism at cp=2 and cp=4 (real gloo groups) against one process: the
attention op alone (outputs and q/k/v gradients, GQA/MHA/MQA, documents crossing the slices), and
a tiny Qwen3 through `LogprobModel(cp_group=...)` (log-probs, entropy, summed parameter gradients)."""

from __future__ import annotations

import pytest

from tandem.errors import ConfigError
from tandem.models.tiny import init_model
from tandem.parallel.context_parallel import check_heads, kv_repeats
from tandem.rl.config import load_run_config
from tests.distributed import run_distributed
from tests.parallel.cp_workers import HEADS, STREAMS, ulysses_checks

TOL = 1e-5


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_results(request):
    return request.param, run_distributed(ulysses_checks, request.param, timeout=240)


def test_ulysses_attention_matches_one_process(cp_results):
    cp, ranks = cp_results
    assert len(ranks[0]["attention"]) == len(STREAMS) * len(HEADS)
    worst = 0.0
    for r in ranks:
        for case, diffs in r["attention"].items():
            assert diffs["scale"] > 0.1, case  # a real signal, not all zeros
            for name in ("out", "grad_q", "grad_k", "grad_v"):
                assert diffs[name] <= TOL, (cp, case, name, diffs[name])
                worst = max(worst, diffs[name])
    print(f"\n[ulysses cp={cp}] max |diff| vs one process over outputs and q/k/v grads: {worst:.2e}")


def test_qwen_through_logprob_model_matches_one_process(cp_results):
    cp, ranks = cp_results
    worst = {"logprobs": 0.0, "entropy": 0.0, "grads": 0.0}
    for r in ranks:
        for case, diffs in r["model"].items():
            assert diffs["grad_scale"] > 1e-3 and diffs["n_params"] > 10, case
            for name in worst:
                assert diffs[name] <= TOL, (cp, case, name, diffs[name])
                worst[name] = max(worst[name], diffs[name])
    print(f"\n[qwen cp={cp}] max |diff| vs one process: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


def test_heads_must_split_over_cp(tmp_path):
    assert kv_repeats(4, 2, 2) == 1 and kv_repeats(4, 2, 4) == 2 and kv_repeats(8, 1, 4) == 4
    assert kv_repeats(12, 4, 6) == 3  # lcm(4, 6) = 12 KV heads: each query head keeps its own
    with pytest.raises(ConfigError, match=r"actor.backend: .* 4 query heads are not divisible by cp=3"):
        check_heads(4, 2, 3)
    # The run config refuses it at load, before anything starts, naming the key.
    model = init_model(tmp_path / "tiny", preset="tiny")
    cfg = load_run_config(None, [f"actor.path={model}", "actor.backend=archon:d2c2"])
    assert (cfg.actor.cp, cfg.actor.tp, cfg.actor.pp) == (2, 1, 1)
    with pytest.raises(ConfigError, match=r"actor.backend='archon:c3': .* 4 query heads are not divisible by cp=3"):
        load_run_config(None, [f"actor.path={model}", "actor.backend=archon:c3"])
