"""Preference pairs (`tandem.data.preferences`): TRL's three row formats encode to the conversation
ids a served reward model scores, bad rows are refused naming the row and the key, pairs from a
task keep only what its reward prefers, and the trainer's layout scores the last real token."""

from __future__ import annotations

import json

import pytest

from tandem.data.preferences import preference_batch, preference_file_pairs, task_pairs
from tandem.data.tasks import get_task
from tandem.data.tasks.base import TaskDataError
from tandem.data.tasks.chat import encode_prompt
from tandem.errors import ConfigError
from tandem.rl.config import load_run_config


@pytest.fixture(scope="module")
def tokenizer():
    from tandem.models.tiny import build_tokenizer

    return build_tokenizer(vocab_size=2048)


def write(tmp_path, rows) -> str:
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_three_row_formats_encode_the_same_conversation(tmp_path, tokenizer):
    """Catches: a format read as another (the prompt dropped, the answer doubled), ids that are not
    the rollout's: prompt ids (the template's, up to the assistant header) + answer + EOS."""
    user = {"role": "user", "content": "What is 2 + 3?"}
    rows = [
        {"prompt": "What is 2 + 3?", "chosen": "\\boxed{5}", "rejected": "6"},
        {"prompt": [user], "chosen": [{"role": "assistant", "content": "\\boxed{5}"}],
         "rejected": [{"role": "assistant", "content": "6"}]},
        {"chosen": [user, {"role": "assistant", "content": "\\boxed{5}"}],
         "rejected": [user, {"role": "assistant", "content": "6"}]},
    ]
    pairs = [preference_file_pairs(write(tmp_path, [r]), tokenizer)[0] for r in rows]
    prompt = encode_prompt({"prompt": "What is 2 + 3?"}, tokenizer)
    want_chosen = prompt + tokenizer.encode("\\boxed{5}", add_special_tokens=False) + [tokenizer.eos_token_id]
    want_rejected = prompt + tokenizer.encode("6", add_special_tokens=False) + [tokenizer.eos_token_id]
    for pair in pairs:
        assert pair.chosen == want_chosen and pair.rejected == want_rejected


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "q", "chosen": "a"}, r"row 1: no 'rejected'"),
    ({"prompt": "q", "chosen": ["a"], "rejected": "b"}, r"row 1: 'chosen' is a list with a str `prompt`"),
    ({"chosen": [{"content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
     r"row 1: 'chosen' holds a message without a `role`"),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
     r"row 1: 'chosen' does not end with an assistant message"),
])
def test_a_bad_row_is_refused_naming_the_file_the_row_and_the_key(tmp_path, tokenizer, row, message):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    with pytest.raises(TaskDataError, match=r"preference file .*prefs.jsonl', " + message):
        preference_file_pairs(write(tmp_path, [good, row]), tokenizer)


def test_task_pairs_keep_only_pairs_the_reward_prefers(tokenizer):
    """Catches: a slipped reference (a wrong answer) chosen, a pair of equal answers kept, a pair
    whose rejected answer is the item's own."""
    task = get_task("arithmetic", difficulty="add1x3", instruction=False, teacher_slip=0.5)
    items = task.generate(200, seed=0)
    pairs = task_pairs(items, task, tokenizer)
    # A slip (the last term left out) is still right when that term is 0: the reward decides.
    right = sum(task.reward(task.sft_target(item), item) == 1.0 for item in items)
    assert right < 150 and 0.85 * right < len(pairs) <= right  # another item's answer is rarely equal
    clean = get_task("arithmetic", difficulty="add1x3", instruction=False)
    decode = tokenizer.decode
    for pair in pairs[:40]:
        chosen, rejected = decode(pair.chosen), decode(pair.rejected)
        question = chosen[: chosen.index("?") + 1]
        item = next(i for i in items if i["prompt"] in question)
        assert clean.reward(chosen, item) == 1.0 and clean.reward(rejected, item) == 0.0
    with pytest.raises(TaskDataError, match="at least two items"):
        task_pairs(items[:1], task, tokenizer)


def test_the_batch_scores_each_member_at_its_last_real_token():
    """Chosen then rejected; one loss position, on the appended score token: in prediction
    alignment that is the member's last real token."""
    from tandem.data.preferences import PreferencePair

    batch = preference_batch([PreferencePair([5, 6, 7], [8, 9])], score_token=0)
    assert [s["input_ids"].tolist() for s in batch.seqs] == [[5, 6, 7, 0], [8, 9, 0]]
    assert [s["loss_mask"].tolist() for s in batch.seqs] == [[0, 0, 0, 1], [0, 0, 1]]


def test_reward_objective_settings_are_refused_naming_the_key(tmp_path):
    from tandem.models.tiny import init_model

    model = init_model(tmp_path / "m", preset="tiny", seed=0)
    with pytest.raises(ConfigError, match=r"sft.preferences is set but does nothing in this run: it needs "
                                          r"sft.objective=reward"):
        load_run_config(None, [f"actor.path={model}", "sft.preferences=p.jsonl"], command="sft")
    with pytest.raises(ConfigError, match=r"sft.objective=reward trains a reward model whole .* actor.lora.rank"):
        load_run_config(None, [f"actor.path={model}", "sft.objective=reward", "actor.lora.rank=4"], command="sft")
    with pytest.raises(ConfigError, match=r"sft.objective"):
        load_run_config(None, [f"actor.path={model}", "sft.objective=dpo"], command="sft")
