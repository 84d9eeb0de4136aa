"""Task data for a run: the resumable train stream and a duplicate-free eval set."""

from __future__ import annotations

from tandem.models.tiny import build_tokenizer
from tandem.rl.config import load_run_config
from tandem.rl.data import CursorLoader, load_task_data


def test_cursor_loader_cycles_counts_and_tags_positions():
    items = [{"id": i} for i in range(3)]
    loader = CursorLoader(items, cursor=2)
    drawn = [next(loader) for _ in range(4)]
    assert [d["id"] for d in drawn] == [2, 0, 1, 2] and [d["stream_index"] for d in drawn] == [2, 3, 4, 5]
    assert loader.cursor == 6 and "stream_index" not in items[0]  # the items themselves are untouched


def test_a_resumed_loader_skips_what_was_done_beyond_its_frontier():
    loader = CursorLoader([{"id": i} for i in range(10)], cursor=4, skip=(2, 5, 7))
    assert [next(loader)["stream_index"] for _ in range(4)] == [4, 6, 8, 9]


def test_eval_set_has_no_repeated_problem():
    """add1 has ~20 eval problems; asking for 100 must not count repeats twice."""
    cfg = load_run_config(None, ["task.options={difficulty: add1, instruction: false}", "task.eval_size=100",
                             "task.train_size=50"])
    data = load_task_data(cfg, build_tokenizer(vocab_size=512))
    prompts = [tuple(item["input_ids"]) for item in data.eval]
    assert len(prompts) == len(set(prompts)) < 100
    assert len(data.train) == 50
