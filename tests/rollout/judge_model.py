"""A judge model for the tests: the tiny model SFT'd to answer `DEFAULT_TEMPLATE` with "yes" when
the answer shown is the true sum of an `add1` arithmetic question, boxed, and "no" when it is a bare
number off by 1-3 (what a tiny model learns in seconds is the format; the verdict's format is what
the tests force)."""

from __future__ import annotations

import random
from pathlib import Path

from tandem.data.batch import SequenceBatch
from tandem.data.tasks import get_task
from tandem.data.tasks.chat import encode_conversation
from tandem.models.tiny import init_model
from tandem.rollout.judge import DEFAULT_TEMPLATE
from tandem.train import TrainEngine
from tandem.train.config import OptimizerConfig
from tandem.train.losses import sft_loss
from tests.train.helpers import engine_config

TASK = get_task("arithmetic", difficulty="add1", instruction=False)


def candidates(n: int, seed: int) -> list[tuple[dict, str, bool]]:
    """(item, answer, correct): each item's true sum boxed, or a wrong one bare."""
    rng = random.Random(seed)
    out = []
    for item in TASK.generate(n, seed=seed):
        correct = rng.random() < 0.5
        wrong = int(item["answer"]) + rng.randint(1, 3)
        out.append((item, f"\\boxed{{{item['answer']}}}" if correct else f"{wrong}", correct))
    return out


def make_judge_model(root: Path, steps: int = 60) -> tuple[Path, Path]:
    """(the base tiny model, the judge SFT'd from it for `steps` steps of 32 examples)."""
    import transformers

    base = init_model(root / "base", preset="tiny", seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    engine = TrainEngine(engine_config(str(base), optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0)))
    examples = []
    for item, answer, correct in candidates(640, seed=1):
        message = DEFAULT_TEMPLATE.format(prompt=item["prompt"], answer=item["answer"], completion=answer)
        examples.append(encode_conversation([{"role": "user", "content": message},
                                             {"role": "assistant", "content": "yes" if correct else "no"}], tokenizer))
    for step in range(steps):
        chunk = examples[step * 32 % len(examples):][:32]
        engine.train_batch(SequenceBatch.from_token_lists([e["input_ids"] for e in chunk],
                                                          loss_mask=[e["loss_mask"] for e in chunk]), sft_loss)
    out = engine.save_hf(root / "judge", tokenizer_dir=base)
    engine.close()
    return base, out
