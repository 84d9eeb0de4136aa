"""A reward whose module takes 1.5 s to import, as a grader that loads a large vocabulary or a
model does: a reward worker pays it once, at its first call, before the call starts."""

from __future__ import annotations

import time

IMPORT_S = 1.5
time.sleep(IMPORT_S)


def quick_reward(prompt_text, completion_text, prompt_ids, completion_ids, **fields) -> float:
    return 1.0
