"""The check the model-parallel `tandem train` tests end with: the trainer's last checkpoint, saved
under the run's layout, loaded into a one-rank engine and written as HF weights, gives in
transformers the same greedy continuations as the server that took the run's updates."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tandem.rl.checkpoints import TRAINER, checkpoint_name, checkpoints_dir
from tandem.train import TrainEngine, TrainEngineConfig
from tests.inference.server_utils import ServerProcess

PROMPTS = ([5, 9, 13], [40, 2, 7, 7, 100, 3])


def assert_server_serves_the_checkpoint(server: ServerProcess, model: Path, run: Path, steps: int,
                                        out: Path) -> None:
    """`model`: the run's initial model directory (config and tokenizer); `run`: its run
    directory, with a checkpoint at `steps`; `out`: where to write the HF weights."""
    engine = TrainEngine(TrainEngineConfig(path=str(model)))
    engine.load_state(checkpoints_dir(run) / checkpoint_name(steps) / TRAINER)
    assert engine.step == steps
    hf_dir = engine.save_hf(out, tokenizer_dir=model)
    engine.close()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert server.ok("/get_weight_version", method="GET") == {"weight_version": str(steps)}
    for ids in PROMPTS:
        got = server.ok("/generate", {"input_ids": ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
        assert got["output_ids"] == want[0, len(ids):].tolist(), (ids, got["output_ids"])
