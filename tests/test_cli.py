"""The `tandem` command as a real process: user mistakes exit 2 with one clear line, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.cli import interrupts_held

TANDEM = str(Path(sys.executable).with_name("tandem"))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TANDEM, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("m") / "qwen3-tiny"
    assert run("init-model", str(out), "--preset", "tiny").returncode == 0
    return out


def assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr


def test_help_lists_commands():
    proc = run("--help")
    assert proc.returncode == 0
    for command in ("alloc", "show-config", "convert-config", "init-model", "model-info"):
        assert command in proc.stdout


def test_model_info(model_dir):
    proc = run("model-info", str(model_dir))
    assert proc.returncode == 0, proc.stderr
    assert "qwen3 with 106,880 parameters" in proc.stdout


def test_missing_model_path(tmp_path):
    assert_user_error(run("model-info", str(tmp_path / "nope")), "model path", "does not exist")


def test_corrupt_safetensors(model_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated mid-tensor
    assert_user_error(run("model-info", str(broken)), "model.safetensors")


def test_bad_config_key_and_type():
    assert_user_error(run("show-config", "actor.optimizer.lrr=1"), "unknown config key 'actor.optimizer.lrr'")
    assert_user_error(run("show-config", "experiment.seed=x"), "experiment.seed: expected an integer, got 'x'")


def test_bad_allocation_string():
    proc = run("alloc", "sglang:d4e2+archon:d2")
    assert_user_error(proc, "dimension 'e' is not valid for inference backend 'sglang'")
    assert "           ^" in proc.stderr  # the caret points at the offending 'e'


def test_alloc_json():
    import json

    proc = run("alloc", "sglang[rollout]:d2+archon[actor]:d2t2", "--json")
    assert proc.returncode == 0, proc.stderr
    comps = json.loads(proc.stdout)["components"]
    assert [(c["name"], c["world_size"]) for c in comps] == [("rollout", 2), ("actor", 4)]


def test_version():
    from tandem import __version__

    proc = run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"tandem {__version__}"


def test_train_without_arguments_prints_usage():
    proc = run("train")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "usage: tandem train CONFIG.yaml [key=value ...]" in proc.stderr
    assert "tandem show-config --keys" in proc.stderr and "docs/rl.md" in proc.stderr


def test_init_model_with_fewer_layers_and_an_untied_head(tmp_path):
    import json

    out = tmp_path / "m"
    proc = run("init-model", str(out), "--preset", "tiny", "--layers", "3", "--untied")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["tie_word_embeddings"] is False
    from safetensors import safe_open

    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and "model.layers.2.mlp.up_proj.weight" in names
    assert not any(n.startswith("model.layers.3.") for n in names)
    assert_user_error(run("init-model", str(tmp_path / "z"), "--layers", "0"), "--layers must be at least 1, got 0")


def test_a_ctrl_c_during_held_imports_is_raised_once_they_end():
    """`tandem train` and `tandem sft` import torch and transformers under `interrupts_held`: a
    Ctrl-C landing inside an import could be swallowed by a library and leave numpy half imported
    (exit 1, "module 'numpy' has no attribute 'minimum'"). The block runs to its end, then the
    KeyboardInterrupt comes, and the previous handler is back."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    finished = []
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the handler runs between bytecodes here, and raises nothing
            finished.append("block")
        assert finished == ["block"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with interrupts_held():  # no Ctrl-C: nothing raised
            finished.append("quiet")
        assert finished == ["block", "quiet"]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_what_train_reads_before_its_first_line_does_not_import_torch():
    """`tandem train` loads the run config, checks the sandbox and plans the trial, then says where it
    writes, before torch and transformers load (seconds; tests/rl/test_run_lifecycle.py times it). Since
    LoRA's config was read from the models room (which imports torch), the first line came after torch:
    this checks the imports themselves, not a race against a timer."""
    code = ("import sys, tandem.cli, tandem.rl.config, tandem.rl.evaluate, tandem.rl.trial; "
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
