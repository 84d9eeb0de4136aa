"""Task data for a run: the resumable train stream and a duplicate-free eval set."""

from __future__ import annotations

from tandem.models.tiny import build_tokenizer
from tandem.rl.config import load_run_config
from tandem.rl.data import CursorLoader, load_task_data


def test_cursor_loader_cycles_and_counts():
    loader = CursorLoader([{"id": i} for i in range(3)], cursor=2)
    assert [next(loader)["id"] for _ in range(4)] == [2, 0, 1, 2]
    assert loader.cursor == 6


def test_eval_set_has_no_repeated_problem():
    """add1 has ~20 eval problems; asking for 100 must not count repeats twice."""
    cfg = load_run_config(None, ["task.options={difficulty: add1, instruction: false}", "task.eval_size=100",
                             "task.train_size=50"])
    data = load_task_data(cfg, build_tokenizer(vocab_size=512))
    prompts = [tuple(item["input_ids"]) for item in data.eval]
    assert len(prompts) == len(set(prompts)) < 100
    assert len(data.train) == 50
