"""A reward model as a run's reward (`reward_model.*`): what the config and the pre-launch check
refuse, naming the key; the launched reward servers taking the section's keys; and `tandem train`
end to end with its rewards from two launched reward servers, one SIGKILLed mid-run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tandem.errors import ConfigError
from tandem.launch import LocalScheduler
from tandem.rl.config import load_run_config
from tandem.rl.scorers import check_scorers, start_scorers
from tests.inference.test_classifier_serving import _hf_classifier
from tests.launch.procs import CHILD_ENV
from tests.rl.common import rl_rows, train_killing_a_server, write_config
from tests.rl.test_launch_keys import CORE, _get
from tests.rollout.conftest import run

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {"reward": _hf_classifier(root, "reward", "sequence", 1),
            "three": _hf_classifier(root, "three", "sequence", 3)}


@pytest.mark.parametrize(("overrides", "message"), [
    (["reward_model.mode=add"], r"reward_model.mode is set but does nothing in this run: it needs reward_model.path"),
    (["reward_model.path={rm}", "reward_model.backend=vllm:d1"],
     r"reward_model.backend='vllm:d1': Tandem reads scores from tandem and sglang servers only"),
    (["reward_model.path={rm}", "reward_model.mode=sum"], r"reward_model.mode"),
    (["reward_model.path={rm}/nowhere"], r"reward_model.path: .*nowhere' does not exist"),
])
def test_reward_model_settings_are_refused_naming_the_key(overrides, message, model_dir, classifiers):
    keys = [o.format(rm=classifiers["reward"]) for o in overrides]
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, [f"actor.path={model_dir}", *keys])
    with pytest.raises(ConfigError, match=r"reward_model.path is set but `tandem sft` has no reward"):
        load_run_config(None, [f"actor.path={model_dir}", f"reward_model.path={classifiers['reward']}"], command="sft")


def test_the_pre_launch_check_wants_a_one_label_classifier_with_the_actors_tokenizer(model_dir, classifiers,
                                                                                       tmp_path):
    check_scorers(load_run_config(None, [f"actor.path={model_dir}", f"reward_model.path={classifiers['reward']}"]))
    for path, message in ((model_dir, r"reward_model.path=.* is Qwen3ForCausalLM: a reward model is a "
                                      r"...ForSequenceClassification with one label"),
                          (classifiers["three"], r"is Qwen3ForSequenceClassification with 3 labels")):
        cfg = load_run_config(None, [f"actor.path={model_dir}", f"reward_model.path={path}"])
        with pytest.raises(ConfigError, match=message):
            check_scorers(cfg)
    other = tmp_path / "other-rm"
    shutil.copytree(classifiers["reward"], other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[20:22]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=r"reward_model.path=.* and actor.path=.* have different tokenizers"):
        check_scorers(load_run_config(None, [f"actor.path={model_dir}", f"reward_model.path={other}"]))


def test_launched_reward_servers_take_the_reward_model_keys(tmp_path, model_dir, classifiers):
    """Catches a `reward_model.*` key not reaching the fleet: two `tandem serve --is-embedding` of
    the path, pinned, with the extra options and the key; the scorer with the deadlines, the mode
    and `min_servers`, scoring a sequence as transformers does."""
    rm = classifiers["reward"]
    cfg = load_run_config(None, [f"actor.path={model_dir}", f"reward_model.path={rm}", "reward_model.backend=tandem:d2",
                                 f"reward_model.cpus={CORE}", "reward_model.server_args=[--num-threads, '1']",
                                 "reward_model.api_key=the-rm-key", "reward_model.min_servers=2",
                                 "reward_model.request_deadline_s=41", "reward_model.call_timeout_s=6",
                                 "reward_model.mode=add"])
    with LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=10) as scheduler:
        (scorer,) = start_scorers(cfg, scheduler, None)  # no judge: the actor's tokenizer goes unused
        assert_scoring_servers(scheduler, "reward_model", rm, "the-rm-key", embedding=True)
        assert (scorer.client.config.deadline_s, scorer.client.config.call_timeout_s) == (41.0, 6.0)
        assert scorer.mode == "add" and scorer.fleet.min_servers == 2
        from tests.rollout.test_reward_model import episode

        t = episode([5, 6, 7, 8], 2, 1.0)
        try:
            run(scorer.ascore([t]))
        finally:
            scorer.close()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    with torch.no_grad():
        want = float(hf(torch.tensor([t.input_ids])).logits[0, 0])
    assert abs(t.reward - (1.0 + want)) < 1e-5


def assert_scoring_servers(scheduler: LocalScheduler, section: str, model: Path, api_key: str,
                           embedding: bool) -> None:
    """Two launched servers of `section` holding `model`, pinned to `CORE`, with one thread, a
    classifier exactly when `embedding`, answering only with `api_key`."""
    assert sorted(p.name for p in scheduler.processes) == [f"{section}-0", f"{section}-1"]
    for handle in scheduler.servers:
        assert os.sched_getaffinity(handle.pid) == {CORE}
        args = Path(f"/proc/{handle.pid}/cmdline").read_text().split("\0")
        assert ("--is-embedding" in args) == embedding and str(model) in args
        status, info = _get(handle.url + "/get_server_info", api_key)
        assert status == 200 and info["num_threads"] == 1 and info["is_embedding"] is embedding, info
        assert _get(handle.url + "/get_server_info")[0] == 401


@pytest.mark.slow
def test_a_run_rewarded_by_a_model_survives_a_dead_reward_server(tmp_path, model_dir, classifiers):
    """`tandem train` with `reward_model.path` on two launched reward servers; after step 1 one is
    SIGKILLed. The run ends normally after 5 steps, no episode lost; every dumped trajectory's
    reward is its reward-model score (mode replace), with the task's 0/1 reward kept beside it."""
    dump = tmp_path / "dump"
    cfg = write_config(tmp_path, model_dir, actor={"backend": "archon:d1"}, rollout={"backend": "tandem:d1",
                                                                                   "dump_dir": str(dump)},
                       reward_model={"path": str(classifiers["reward"]), "backend": "tandem:d2",
                                     "server_args": ["--num-threads", "1"]},
                       train={"total_steps": 5})
    train_killing_a_server(tmp_path, cfg, "reward_model-0.log", after_steps=1)
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["rollout/lost_total"] == 0 for r in rows)
    assert rows[-1]["reward_model/scored_total"] >= 5 * 4 * 2  # 5 batches of 4 episodes x 2 samples
    trajs = [json.loads(line) for f in sorted(dump.glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert len(trajs) >= 40
    for t in trajs:
        assert t["reward"] == t["info"]["reward_model_score"] and t["info"]["task_reward"] in (0.0, 1.0)
