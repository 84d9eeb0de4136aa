"""`tandem train` with a model-parallel trainer (archon:t2, archon:p2, archon:c2): the RL loop runs
with distributed weight sync, and what the servers hold is the trainer's model.

Three independent checks per layout:
- every update is verified (`train.verify_weights`: per-tensor checksums of each server equal
  those of the trainer's export, or the update fails and so does the run);
- staleness 0: the trainer's log-probs of the generated tokens, computed under the layout, equal
  the servers' (`mismatch/max` <= 1e-5), and every token came from the current version;
- after the run, the trainer's last checkpoint (saved under the layout) loaded into a one-rank
  engine and written as HF weights gives, in transformers, the same greedy continuations as the
  server that took the updates (it outlives the run: the test started it).
"""

from __future__ import annotations

import subprocess

import pytest

from tandem.models.tiny import init_model
from tests.inference.server_utils import ServerProcess
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config
from tests.rl.served_model import assert_server_serves_the_checkpoint

pytestmark = pytest.mark.slow
STEPS = 2


@pytest.fixture(scope="module")
def model_4l(tmp_path_factory):
    """The tiny preset with 4 blocks (p2: 2 per stage; 4 heads, 2 KV heads: t2 and c2 split them)."""
    return init_model(tmp_path_factory.mktemp("m") / "tiny-4l", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": 4})


@pytest.mark.parametrize("backend", ["archon:t2", "archon:p2", "archon:c2"])
def test_rl_loop_under_a_model_parallel_layout(tmp_path, model_4l, backend):
    server = ServerProcess(model_4l, tmp_path)
    try:
        cfg = write_config(
            tmp_path, model_4l, actor={"backend": backend},
            rollout={"backend": "tandem:d1", "servers": [server.url], "max_head_offpolicyness": 0},
            train={"total_steps": STEPS, "weight_sync": "distributed", "verify_weights": True, "save_every": STEPS})
        proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        log = (run_dir(tmp_path) / "logs" / "actor-rank0.log").read_text()
        sizes = {"archon:t2": "tp=2 cp=1", "archon:p2": "pp=2", "archon:c2": "cp=2"}[backend]
        assert "parallel dims:" in log and sizes in log.split("parallel dims:")[1].splitlines()[0], log[-2000:]
        rows = rl_rows(tmp_path)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        for r in rows:
            assert r["mismatch/max"] <= 1e-5 and r["mismatch/n_tokens"] > 0, r
            assert r["staleness/max"] == 0.0 and r["version"] == r["step"]

        # The trainer's final model, read back at d1 from the layout's checkpoint.
        assert_server_serves_the_checkpoint(server, model_4l, run_dir(tmp_path), STEPS, tmp_path / "final")
    finally:
        server.stop()
