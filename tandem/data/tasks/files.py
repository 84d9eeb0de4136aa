"""Reading a task's local data file (JSON lines or parquet) with `datasets`, never from a hub.

`read_table` checks the extension and that the file exists, reads it, and refuses a file with no
rows; every refusal is a `TaskDataError` naming the file. Checking the columns and the rows is the
caller's (each task's loader knows its own fields)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.data.tasks.base import TaskDataError, split_of

if TYPE_CHECKING:
    import datasets

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_table(path: str | Path, what: str, fix: str, cache_dir: str | None = None) -> datasets.Dataset:
    """The rows of a local .jsonl/.json (JSON lines) or .parquet file as a `datasets.Dataset`.

    `what` names the file in errors ("GSM8K file"), `fix` says what a valid file holds."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise TaskDataError(f"{what} {str(path)!r}: unsupported extension {path.suffix!r}; "
                            "use a .jsonl/.json (JSON lines) or .parquet file")
    if not path.is_file():
        raise TaskDataError(f"{what} {str(path)!r} not found; fix the path (a local JSONL or parquet "
                            f"file: {fix})")
    # `datasets` fails on a file without rows with its own puzzling errors (StopIteration, "corresponds
    # to no data", ArrowInvalid): say it plainly first.
    if _has_no_rows(path, fmt):
        raise TaskDataError(f"{what} {str(path)!r} has no rows; {fix}")
    import datasets  # heavy: only when a file is actually read

    try:
        data = datasets.load_dataset(fmt, data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as exc:
        raise TaskDataError(f"{what} {str(path)!r} could not be read as {fmt}: {type(exc).__name__}: "
                            f"{exc}") from exc
    if len(data) == 0:
        raise TaskDataError(f"{what} {str(path)!r} has no rows; {fix}")
    return data


def split_rows(task: str, split: str, train_file: str, eval_file: str | None, load: Callable[[str], list[dict[str, Any]]],
               key: Callable[[dict[str, Any]], str], eval_fraction: float) -> list[dict[str, Any]]:
    """The rows of `split` ('train' or 'eval'): with `eval_file`, the whole file of that split;
    otherwise `train_file`'s rows whose `key` hashes into it (`split_of`). An empty split is a
    TaskDataError saying what to change."""
    if eval_file is not None:
        return load(train_file if split == "train" else eval_file)
    rows = [r for r in load(train_file) if split_of(f"{task}:{key(r)}", eval_fraction) == split]
    if not rows:
        raise TaskDataError(f"{task}: the {split!r} split of {train_file!r} is empty; add rows, "
                            "change eval_fraction or give an eval_file")
    return rows


def _has_no_rows(path: Path, fmt: str) -> bool:
    """Whether the file surely has no rows: JSON that is only whitespace or `[]`, parquet whose
    footer counts none. Unsure (unreadable) is False: reading it then reports why."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_metadata(path).num_rows == 0
        except Exception:
            return False
    head = b""  # the first two bytes that are not whitespace
    with path.open("rb") as f:
        while len(head) < 2 and (chunk := f.read(1 << 16)):
            head += chunk.translate(None, b" \t\r\n\f\v")[: 2 - len(head)]
    return head in (b"", b"[]")
