"""The reward of bench/chaos.py's run (`rollout.reward=bench/chaos_reward.py:reward`): the parity of
the last token (the tiny random model earns it half the time, so groups have advantages), and a
hang each time the bench arms it.

The bench arms a hang by creating the file named by $TANDEM_CHAOS_HANG; the first reward call that
renames it away (atomic: one call wins) notes the time in `<file>.log` and sleeps far past
`task.reward_timeout_s`, which interrupts it: that sample's reward fails, and with it its group.
"""

from __future__ import annotations

import os
import time

HANG_S = 600.0


def reward(prompt_text, completion_text, prompt_ids, completion_ids, **fields) -> float:
    flag = os.environ.get("TANDEM_CHAOS_HANG")
    if flag:
        try:
            os.rename(flag, f"{flag}.taken")
        except OSError:
            pass
        else:
            with open(f"{flag}.log", "a") as log:
                log.write(f"{time.time()}\n")
            time.sleep(HANG_S)
    return float(completion_ids[-1] % 2 == 0) if completion_ids else 0.0
