"""GSM8K-format loading from local JSONL/parquet files, its errors, and math-verify scoring."""

from __future__ import annotations

import json

import pytest

from tandem.data.tasks import GSM8KTask, TaskDataError, get_task, gsm8k_reward, load_gsm8k_file
from tandem.data.tasks.gsm8k import final_answer, math_verify_equal
from tandem.errors import ConfigError

ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A bag holds 1,000 beads. How many beads are in 3 bags?",
     "answer": "3 bags hold 3*1000 = <<3*1000=3000>>3000 beads.\n#### 3,000"},
    {"question": "Half of a pie is eaten. What fraction is left?", "answer": "1 - 1/2 = 1/2\n#### 0.5"},
] + [{"question": f"Sam has {k} apples and eats 1. How many are left?",
      "answer": f"{k}-1 = <<{k}-1={k - 1}>>{k - 1}\n#### {k - 1}"} for k in range(2, 40)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(params=["jsonl", "parquet"])
def data_file(request, tmp_path):
    if request.param == "jsonl":
        return _jsonl(tmp_path / "train.jsonl", ROWS)
    return _parquet(tmp_path / "train.parquet", ROWS)


def test_loads_jsonl_and_parquet(data_file, tmp_path):
    rows = load_gsm8k_file(data_file, cache_dir=str(tmp_path / "cache"))
    assert [r["answer"] for r in rows[:3]] == ["72", "3000", "0.5"]
    assert rows[0]["question"] == ROWS[0]["question"] and rows[0]["solution"] == ROWS[0]["answer"]
    assert [r["row"] for r in rows] == list(range(len(ROWS)))


def test_items_splits_and_sft_targets(data_file, tmp_path):
    task = get_task("gsm8k", train_file=str(data_file), eval_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    train, evals = task.generate(seed=0), task.generate(seed=0, split="eval")
    assert len(train) + len(evals) == len(ROWS) and evals
    assert not {i["prompt"] for i in train} & {i["prompt"] for i in evals}
    assert task.generate(5, seed=3) == task.generate(5, seed=3) != task.generate(5, seed=4)
    assert len(task.generate(100, seed=0)) == 100  # past the end rows repeat, reshuffled
    for it in train + evals:
        assert it["task"] == "gsm8k" and it["prompt"].endswith("Put your final answer in \\boxed{}.")
        target = task.sft_target(it)
        assert "<<" not in target and "####" not in target and target.endswith(f"\\boxed{{{it['answer']}}}")
        assert task.reward(target, it) == 1.0
        assert gsm8k_reward("", target, [], [], **it) == 1.0
    natalia = next(i for i in train + evals if i["answer"] == "72")
    assert task.sft_target(natalia).startswith("Natalia sold 48/2 = 24 clips in May.\n")


def test_separate_eval_file_and_pickling_drops_rows(tmp_path):
    train = _jsonl(tmp_path / "a.jsonl", ROWS[:10])
    evals = _parquet(tmp_path / "b.parquet", ROWS[10:14])
    task = GSM8KTask(train_file=str(train), eval_file=str(evals), cache_dir=str(tmp_path / "cache"))
    assert len(task.generate(split="train")) == 10 and len(task.generate(split="test")) == 4
    import pickle

    clone = pickle.loads(pickle.dumps(task.reward_fn()))
    assert clone.task._rows == {} and task._rows
    item = task.generate(1)[0]
    assert clone("", f"\\boxed{{{item['answer']}}}", [], [], **item) == 1.0


@pytest.mark.parametrize(
    ("completion", "reference", "equal"),
    [
        ("\\boxed{72}", "72", True),
        ("So she sold 72 clips.", "72", True),
        ("\\boxed{72.0}", "72", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("the answer is 0.5", "\\frac{1}{2}", True),
        ("\\boxed{1/2}", "0.5", True),
        ("\\boxed{3,000}", "3000", True),
        ("\\boxed{71}", "72", False),
        ("\\boxed{0.49}", "0.5", False),
        ("I think \\boxed{5} no wait \\boxed{72}", "72", True),  # the last boxed
        ("\\boxed{72} no wait \\boxed{5}", "72", False),
        ("<answer>72</answer>", "72", True),
        ("<answer> 72 clips </answer>", "72", True),
        ("so 12 and then -3", "-3", True),
        ("", "72", False),
        ("no answer at all", "72", False),
        ("\\boxed{\\frac{1}{", "0.5", False),  # malformed LaTeX: False, never an exception
    ],
)
def test_math_verify_equivalences(completion, reference, equal):
    assert math_verify_equal(completion, reference) is equal


def test_format_weight():
    task = GSM8KTask(format_weight=0.1)  # scoring needs no file
    assert task.reward("\\boxed{71}", {"answer": "72"}) == 0.1
    assert task.reward("71", {"answer": "72"}) == 0.0
    assert task.reward("\\boxed{72}", {"answer": "72"}) == 1.0


def test_final_answer():
    assert final_answer("blah\n#### 1,234") == "1234"
    assert final_answer("a #### 1 #### -5 ") == "-5"
    assert final_answer("no marker 72") is None


# ---------------------------------------------------------------- errors name the file and the fix


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(TaskDataError, match=r"nope\.jsonl' not found; fix the path") as err:
        load_gsm8k_file(missing)
    assert isinstance(err.value, ConfigError)
    with pytest.raises(TaskDataError, match="no data file; set train_file"):
        GSM8KTask().generate(3)


def test_unsupported_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("question,answer\n")
    with pytest.raises(TaskDataError, match=r"data\.csv.*unsupported extension '\.csv'"):
        load_gsm8k_file(path)


def test_missing_fields(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [{"problem": "1+1?", "solution": "#### 2"}])
    with pytest.raises(TaskDataError, match=r"bad\.jsonl' lacks field\(s\) 'question', 'answer' \(it has 'problem', "
                                            r"'solution'\)"):
        load_gsm8k_file(path, cache_dir=str(tmp_path / "cache"))


def test_answer_without_marker(tmp_path):
    path = _parquet(tmp_path / "bad.parquet", [*ROWS[:2], {"question": "1+1?", "answer": "It is 2."}])
    with pytest.raises(TaskDataError, match=r"bad\.parquet', row 3: the answer 'It is 2\.' has no final answer "
                                            r"after '####'; end it with a line like '#### 72'"):
        load_gsm8k_file(path, cache_dir=str(tmp_path / "cache"))


def test_unreadable_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question": "1+1?", "answer": "#### 2"}\n{not json\n')
    with pytest.raises(TaskDataError, match=r"broken\.jsonl' could not be read as json"):
        load_gsm8k_file(path, cache_dir=str(tmp_path / "cache"))
