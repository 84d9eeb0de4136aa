"""GSM8K-format math word problems from local files, scored with `math-verify`.

A file is JSONL or parquet with `question` and `answer` per row, the answer ending in
`#### <final answer>`; files are read with `datasets`, never from a hub. With only `train_file` its
rows are split by a hash of the question; with `eval_file` each file is one split. The reward takes
the answer span by the shared rule and compares it with `math_verify`, so "0.5", "1/2" and
"\frac{1}{2}" agree. See docs/tasks.md, "gsm8k"."""

from __future__ import annotations

import logging
import random
import re
import signal
import threading
from pathlib import Path
from typing import Any

from tandem.data.tasks.base import (
    Task,
    TaskDataError,
    check_fraction,
    cycled_order,
    normalize_split,
)
from tandem.data.tasks.extract import answer_span
from tandem.data.tasks.files import read_table, split_rows

REQUIRED_FIELDS = ("question", "answer")
INSTRUCTION = "Put your final answer in \\boxed{}."
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: "<<48/2=24>>"
_FIX = "each row needs a 'question' and an 'answer' that ends in '#### <final answer>'"


def final_answer(solution: str) -> str | None:
    """The text after the last '####' with thousands commas removed; None if there is no '####'."""
    if "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def load_gsm8k_file(path: str | Path, cache_dir: str | None = None) -> list[dict[str, Any]]:
    """Rows of a GSM8K-format file as {"question", "solution", "answer", "row"} dicts, validated."""
    path = Path(path)
    data = read_table(path, "GSM8K file", _FIX, cache_dir)
    missing = [f for f in REQUIRED_FIELDS if f not in data.column_names]
    if missing:
        raise TaskDataError(f"GSM8K file {str(path)!r} lacks field(s) {', '.join(map(repr, missing))} "
                            f"(it has {', '.join(map(repr, data.column_names)) or 'none'}); {_FIX}")
    rows = []
    for i, (question, solution) in enumerate(zip(data["question"], data["answer"], strict=True)):
        where = f"GSM8K file {str(path)!r}, row {i + 1}"
        if not isinstance(question, str) or not question.strip():
            raise TaskDataError(f"{where}: 'question' is empty or not text; {_FIX}")
        if not isinstance(solution, str):
            raise TaskDataError(f"{where}: 'answer' is {type(solution).__name__}, not text; {_FIX}")
        answer = final_answer(solution)
        if not answer:
            shown = solution if len(solution) <= 60 else solution[:57] + "..."
            raise TaskDataError(f"{where}: the answer {shown!r} has no final answer after '####'; "
                                "end it with a line like '#### 72'")
        rows.append({"question": question.strip(), "solution": solution, "answer": answer, "row": i})
    return rows


def _timeouts_usable() -> bool:
    """math-verify's own timeouts use SIGALRM: only on the main thread, and not when a timer is
    already armed (the reward runner's; math-verify's alarm would cancel it)."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )


class _DropTimeoutNotice(logging.Filter):
    # With timeouts off on purpose (the reward runner times rewards out), the notice is noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_notice_filter = _DropTimeoutNotice()


def math_verify_equal(completion_text: str, reference: str) -> bool:
    """Whether the completion's final answer equals `reference` by `math_verify`; never raises."""
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _notice_filter not in logger.filters:
            logger.addFilter(_notice_filter)
    timeout = 5 if _timeouts_usable() else None
    try:
        gold = parse(reference if "\\" in reference or "$" in reference else f"${reference}$",
                     parsing_timeout=timeout)
        source, span = answer_span(completion_text)
        # One answer: the last \\boxed{} (math-verify would take every boxed as a set), else what
        # math-verify finds in the last <answer> tags, else in the whole text.
        pred_text = f"\\boxed{{{span}}}" if source == "boxed" else span
        pred = parse(pred_text, parsing_timeout=timeout)
        if not gold or not pred:
            return False
        return bool(verify(gold, pred, timeout_seconds=timeout))
    except Exception:
        return False


class GSM8KTask(Task):
    name = "gsm8k"

    def __init__(
        self,
        train_file: str | None = None,
        eval_file: str | None = None,
        eval_fraction: float = 0.1,
        instruction: bool = True,
        cache_dir: str | None = None,
        system_prompt: str | None = None,
        format_weight: float = 0.0,
    ):
        super().__init__(system_prompt=system_prompt, format_weight=format_weight)
        self.train_file = train_file
        self.eval_file = eval_file
        self.eval_fraction = check_fraction(eval_fraction)
        self.instruction = instruction
        self.cache_dir = cache_dir
        self._rows: dict[str, list[dict[str, Any]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # The task travels to reward workers with every call: never ship the loaded rows.
        return {**self.__dict__, "_rows": {}}

    def rows(self, split: str) -> list[dict[str, Any]]:
        """The validated rows of `split` (loaded once)."""
        split = normalize_split(split)
        if split not in self._rows:
            if self.train_file is None:
                raise TaskDataError("gsm8k: no data file; set train_file (and optionally eval_file) to a local "
                                    f"JSONL or parquet file; {_FIX}")
            self._rows[split] = split_rows("gsm8k", split, self.train_file, self.eval_file,
                                           lambda path: load_gsm8k_file(path, self.cache_dir),
                                           lambda row: row["question"], self.eval_fraction)
        return self._rows[split]

    def generate(self, n: int | None = None, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        """`n` items in a seeded order (all rows when `n` is None; rows repeat, reshuffled, past the end)."""
        split = normalize_split(split)
        rows = self.rows(split)
        n = len(rows) if n is None else n
        items = []
        for i, k in enumerate(cycled_order(len(rows), n, random.Random(f"gsm8k:{seed}:{split}"))):
            r = rows[k]
            prompt = r["question"] + (f"\n{INSTRUCTION}" if self.instruction else "")
            items.append(self.make_item(i, seed, split, prompt, r["answer"], solution=r["solution"], row=r["row"]))
        return items

    def sft_target(self, item: dict[str, Any]) -> str:
        """The reference solution without calculator annotations, ending in `\\boxed{answer}`."""
        reasoning = _CALCULATOR.sub("", item["solution"].rsplit("####", 1)[0]).strip()
        boxed = f"\\boxed{{{item['answer']}}}"
        return f"{reasoning}\n{boxed}" if reasoning else boxed

    def reward(self, completion_text: str, item: dict[str, Any]) -> float:
        if math_verify_equal(completion_text, str(item["answer"])):
            return 1.0
        if self.format_weight and "\\boxed" in completion_text:
            return self.format_weight
        return 0.0
