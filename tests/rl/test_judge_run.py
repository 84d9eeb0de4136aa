"""An LLM judge as a run's reward (`judge.*`): what the config and the pre-launch check refuse,
naming the key; the launched judge servers taking the section's keys; and `tandem train` end to end
with its rewards from a launched judge (the tiny model SFT'd to answer yes or no)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.errors import ConfigError
from tandem.launch import LocalScheduler
from tandem.rl.config import load_run_config
from tandem.rl.scorers import check_scorers, start_scorers
from tests.inference.test_classifier_serving import _hf_classifier
from tests.launch.procs import CHILD_ENV
from tests.rl.common import TANDEM, rl_rows, write_config
from tests.rl.test_launch_keys import CORE
from tests.rl.test_reward_model_run import assert_scoring_servers
from tests.rollout.conftest import run
from tests.rollout.judge_model import make_judge_model
from tests.rollout.test_judge import trajectories

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def judge(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny base model, the judge SFT'd from it): they share a tokenizer."""
    return make_judge_model(tmp_path_factory.mktemp("judge"))


@pytest.mark.parametrize(("overrides", "message"), [
    (["judge.parser=number"], r"judge.parser is set but does nothing in this run: it needs judge.path"),
    (["judge.path={judge}", "judge.backend=vllm:d1"], r"judge.backend='vllm:d1'"),
    (["judge.path={judge}", "judge.mode=sum"], r"judge.mode"),
    (["judge.path={judge}", "judge.template='{{prompt}} is it right?'"], r"judge.template has no \{completion\}"),
    (["judge.path={judge}", "judge.template='{{completion}} {{0}}'"], r"judge.template: \{0\} is not a field name"),
    (["judge.path={judge}", "judge.template='{{completion'"], r"judge.template: .*brace"),
    (["judge.path={judge}", "judge.parser=no_such_module:parse"], r"judge.parser: cannot import the module"),
    (["judge.path={judge}", "judge.max_new_tokens=0"], r"judge.max_new_tokens"),
    (["judge.path={judge}", "reward_model.path={judge}"], r"reward_model.path and judge.path are both set"),
])
def test_judge_settings_are_refused_naming_the_key(overrides, message, judge):
    base, model = judge
    keys = [o.format(judge=model) for o in overrides]
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, [f"actor.path={base}", *keys])
    with pytest.raises(ConfigError, match=r"judge.path is set but `tandem sft` has no reward"):
        load_run_config(None, [f"actor.path={base}", f"judge.path={model}"], command="sft")


def test_the_pre_launch_check_wants_a_causal_lm(judge, tmp_path):
    base, model = judge
    check_scorers(load_run_config(None, [f"actor.path={base}", f"judge.path={model}"]))
    classifier = _hf_classifier(tmp_path, "rm", "sequence", 1)
    with pytest.raises(ConfigError, match=r"judge.path=.* is Qwen3ForSequenceClassification, a classifier: a judge "
                                          r"writes its verdict"):
        check_scorers(load_run_config(None, [f"actor.path={base}", f"judge.path={classifier}"]))


def test_launched_judge_servers_take_the_judge_keys(tmp_path, judge):
    """Catches a `judge.*` key not reaching the fleet: two `tandem serve` of the path, pinned, with
    the extra options and the key; the scorer with the deadlines, `min_servers`, the template, the
    parser, the verdict length and the mode."""
    import transformers

    base, model = judge
    cfg = load_run_config(None, [
        f"actor.path={base}", f"judge.path={model}", "judge.backend=tandem:d2", f"judge.cpus={CORE}",
        "judge.server_args=[--num-threads, '1']", "judge.api_key=the-judge-key", "judge.min_servers=2",
        "judge.request_deadline_s=41", "judge.call_timeout_s=6", "judge.mode=add", "judge.max_new_tokens=1",
        "judge.parser=tests.rl.test_judge_run:length_of",
        "judge.template='Say yes or no. Answer: {completion} Question: {prompt} Truth: {answer}'"])
    tok = transformers.AutoTokenizer.from_pretrained(base)
    with LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=10) as scheduler:
        (scorer,) = start_scorers(cfg, scheduler, tok)
        assert_scoring_servers(scheduler, "judge", model, "the-judge-key", embedding=False)
        assert (scorer.client.config.deadline_s, scorer.client.config.call_timeout_s) == (41.0, 6.0)
        assert scorer.fleet.min_servers == 2
        item, t, _ = trajectories(tok, 1, seed=5)[0]
        message = tok.decode(scorer.judge_ids(t, item), skip_special_tokens=True)
        answer = tok.decode([i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if m], skip_special_tokens=True)
        assert f"Say yes or no. Answer: {answer} Question: {item['prompt']} Truth: {item['answer']}" in message
        task_reward = t.reward
        try:
            run(scorer.ascore([t], item))
        finally:
            scorer.close()
    verdict = t.info["judge_text"]
    assert len(tok.encode(verdict, add_special_tokens=False)) <= 1  # judge.max_new_tokens=1
    assert t.reward == task_reward + len(verdict) and t.info["judge_score"] == len(verdict)  # mode add, the parser


def length_of(text: str) -> float:
    """A `judge.parser` for the launch test: the verdict's length."""
    return float(len(text))


@pytest.mark.slow
def test_a_run_rewarded_by_a_judge(tmp_path, judge):
    """`tandem train` with `judge.path` on one launched judge server: the run ends normally after 3
    steps, no episode lost; every dumped trajectory's reward is its judge's parsed verdict, with the
    raw verdict and the task's 0/1 reward kept beside it."""
    import subprocess

    base, model = judge
    dump = tmp_path / "dump"
    cfg = write_config(tmp_path, base, actor={"backend": "archon:d1"},
                       rollout={"backend": "tandem:d1", "dump_dir": str(dump)},
                       judge={"path": str(model), "backend": "tandem:d1", "server_args": ["--num-threads", "1"]},
                       train={"total_steps": 3})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/lost_total"] == 0 for r in rows)
    assert rows[-1]["judge/scored_total"] >= 3 * 4 * 2  # 3 batches of 4 episodes x 2 samples
    trajs = [json.loads(line) for f in sorted(dump.glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert len(trajs) >= 24
    for t in trajs:
        info = t["info"]
        assert t["reward"] == info["judge_score"] and info["task_reward"] in (0.0, 1.0)
        assert info["judge_score"] == (1.0 if info["judge_text"].strip().lower().startswith("yes") else 0.0)
    print(f"\n[judge run] verdicts: {sorted({t['info']['judge_text'] for t in trajs})}; unparsed "
          f"{rows[-1]['judge/unparsed_total']:.0f}")
