"""`tandem sft sft.objective=reward` as a user runs it: Bradley-Terry training of a reward model on
preference pairs made from the task, split whole across two trainer ranks (equal to one rank),
saved as a one-label token classifier that `tandem serve --is-embedding` serves with transformers'
own scores, and that prefers the correct answer on held-out prompts it never trained on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tandem.data.preferences import preference_file_pairs
from tests.inference.server_utils import ServerProcess
from tests.rl.common import TANDEM, run_dir, write_config
from tests.train.helpers import rel_diff

pytestmark = pytest.mark.slow

TASK = {"name": "arithmetic", "options": {"difficulty": "add1x3", "instruction": False, "teacher_slip": 0.0},
        "train_size": 2000, "eval_size": 64}


def reward_sft(tmp_path: Path, model: Path, backend: str, steps: int, **sft) -> tuple[subprocess.CompletedProcess,
                                                                                      list[dict]]:
    tmp_path.mkdir()
    cfg = write_config(tmp_path, model, actor={"backend": backend, "optimizer": {"lr": 1e-3}}, task=TASK,
                       sft={"objective": "reward", "steps": steps, "batch_size": 16, **sft})
    proc = subprocess.run([TANDEM, "sft", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "sft-metrics.jsonl").read_text().splitlines()]
    return proc, rows


def test_two_ranks_take_the_steps_one_rank_takes(tmp_path, model_dir):
    """Catches: pairs split across ranks (a partner's score missing), a loss or gradient averaged
    per rank instead of over every pair, stats of one rank's pairs only."""
    _, one = reward_sft(tmp_path / "d1", model_dir, "archon:d1", 3)
    _, two = reward_sft(tmp_path / "d2", model_dir, "archon:d2", 3)
    steps = [[r for r in rows if "reward/loss" in r] for rows in (one, two)]
    assert [r["step"] for r in steps[1]] == [1, 2, 3] and all(r["reward/pairs"] == 16 for r in steps[1])
    for key in ("reward/loss", "reward/grad_norm", "reward/margin"):
        worst = max(rel_diff(a[key], b[key]) for a, b in zip(*steps, strict=True))
        print(f"\n[reward sft archon:d2 vs d1] {key}: max rel diff {worst:.2e}")
        assert worst <= 1e-5
    assert steps[0][0]["reward/loss"] != steps[0][-1]["reward/loss"]  # it trains


def write_preferences(path: Path, n: int) -> Path:
    """TRL's standard preference rows: a question, the boxed answer chosen over a bare wrong one."""
    rows = []
    for i in range(n):
        a, b = i % 10, (i * 7) % 10
        rows.append({"prompt": f"What is {a} + {b}?", "chosen": f"\\boxed{{{a + b}}}", "rejected": f"{a + b + 1}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_trained_reward_model_is_served_and_prefers_what_it_was_taught(tmp_path, model_dir):
    """From a file of preference pairs (its last task.eval_size rows held out): the held-out loss
    starts at log 2 (the head starts at zero: every pair a tie) and falls, the chosen answers win;
    the saved model is a one-label token classifier whose served scores are transformers' own."""
    import transformers

    prefs = write_preferences(tmp_path / "prefs.jsonl", 300)
    proc, rows = reward_sft(tmp_path / "rm", model_dir, "archon:d2", 30, preferences=str(prefs))
    before, after = (r for r in rows if "eval/reward_accuracy" in r)
    print(f"\n[reward sft] held-out pairs: loss {before['eval/reward_loss']:.3f} -> {after['eval/reward_loss']:.3f}, "
          f"accuracy {before['eval/reward_accuracy']:.3f} -> {after['eval/reward_accuracy']:.3f} "
          f"({after['eval/reward_pairs']:.0f} pairs)")
    assert "held-out pairs: accuracy" in proc.stdout
    assert after["eval/reward_pairs"] == TASK["eval_size"]
    assert before["eval/reward_loss"] == pytest.approx(0.693147, abs=1e-5)
    assert after["eval/reward_loss"] < 0.3 and after["eval/reward_accuracy"] > 0.9
    out = run_dir(tmp_path / "rm") / "sft"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForTokenClassification"] and len(config["id2label"]) == 1
    # Served: the scores of held-out conversations are transformers' own, at the last token.
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    pairs = preference_file_pairs(prefs, tokenizer)[-4:]
    seqs = [s for p in pairs for s in (p.chosen, p.rejected)]
    hf = transformers.AutoModelForTokenClassification.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [float(hf(torch.tensor([s])).logits[0, -1, 0]) for s in seqs]
    (tmp_path / "logs").mkdir()
    server = ServerProcess(out, tmp_path / "logs", "--is-embedding")
    try:
        got = [r["embedding"][0] for r in server.ok("/classify", {"input_ids": seqs})]
    finally:
        server.stop()
    assert got == pytest.approx(want, abs=1e-5)
    assert all(got[2 * k] > got[2 * k + 1] for k in range(len(pairs)))
