"""The progress bar of a run: step, reward, eval accuracy, step time, staleness."""

from __future__ import annotations

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self._bar = tqdm(total=total, initial=start, desc="rl", unit="step", disable=not enabled, dynamic_ncols=True)

    def update(self, stats: dict[str, float], accuracy: float | None) -> None:
        step_s = sum(stats.get(f"time/{k}", 0.0) for k in ("generation", "train", "sync"))
        fields = {
            "reward": f"{stats.get('reward/mean', float('nan')):.3f}",
            "acc": "-" if accuracy is None else f"{accuracy:.3f}",
            "step_s": f"{step_s:.1f}",
            "stale": f"{stats.get('staleness/mean', 0.0):.2f}",
        }
        self._bar.set_postfix(fields, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
