"""Every config value is checked when the config is loaded: documented ranges, task names and
options, allocations the launcher cannot run, the model directory, and features that do not exist
yet. Each error names the key and says how to fix it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.errors import ConfigError
from tandem.models.tiny import init_model
from tandem.rl.config import load_run_config
from tests.timing import refusal_bound_s

TANDEM = str(Path(sys.executable).with_name("tandem"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("validation") / "tiny", preset="tiny", seed=0)


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        # documented ranges
        ("gen.top_p=1.5", ["gen.top_p: 1.5 is above the maximum 1.0", "(0.0, 1.0]"]),
        ("gen.top_p=0", ["gen.top_p: 0.0 must be greater than 0.0"]),
        ("gen.top_k=0", ["gen.top_k: 0", "-1 (the whole vocabulary) or at least 1"]),
        ("gen.temperature=nan", ["gen.temperature: nan is not a finite number"]),
        ("experiment.seed=99999999999", ["experiment.seed: 99999999999 is above the maximum 4294967295"]),
        ("actor.optimizer.beta2=1.0", ["actor.optimizer.beta2: 1.0 must be less than 1.0"]),
        ("actor.optimizer.warmup_steps_proportion=2", ["warmup_steps_proportion: 2.0 is above the maximum 1.0"]),
        ("rollout.request_deadline_s=0", ["rollout.request_deadline_s: 0.0 must be greater than 0.0"]),
        ("rollout.callback_port=70000", ["rollout.callback_port: 70000 is above the maximum 65535"]),
        ("rollout.max_consecutive_failures=0", ["rollout.max_consecutive_failures: 0 is below the minimum 1"]),
        ("experiment.trial=a/b", ["experiment.trial: 'a/b'", "one directory name"]),
        ("experiment.name=..", ["experiment.name: '..'", "one directory name"]),
        ("cluster.host_ip=trainer-host", ["cluster.host_ip: 'trainer-host' is not an IP address"]),
        ("algo.ppo.eps_clip=1.5", ["algo.ppo.eps_clip must be in [0, 1), got 1.5"]),
        # task names and options (the task is built)
        ("task.name=nope", ["task.name: unknown task 'nope'", "arithmetic", "countdown", "gsm8k"]),
        ("task.options={colour: red}", ["task.options: task 'arithmetic' has no option 'colour'", "difficulty"]),
        ("task.options={difficulty: add99}", ["task.options:", "add99"]),
        # layouts this version cannot run
        ("rollout.backend=tandem:d2t2", ["rollout.backend", "one device per server", "tandem:d4"]),
        ("rollout.min_servers=3", ["rollout.min_servers=3 is more than the 1 server(s) the run starts with",
                                   "rollout.backend='tandem:d1'"]),
        ("actor.backend=archon:(attn:d2t2|ffn:e1t4)", ["actor.backend", "etp=4 must be 1 or the attention's tp=2",
                                                       "ffn:e1t2"]),
        ("actor.backend=archon:c4e2", ["actor.backend", "ep (2) must divide dp_shard * cp = 4 and be a multiple of "
                                                         "cp = 4"]),
        ("actor.backend=archon:c3t2e2", ["actor.backend", "ep (2) must divide dp_shard * cp = 3",
                                         "or a multiple of cp*tp = 6 with etp=1 (experts folded over the TP ranks)"]),
        ("actor.tp=2", ["actor.tp", "actor.backend (e.g. archon:d2t2)"]),
        ("actor.parallelize.offload_params=true", ["actor.parallelize.offload_params=true needs an accelerator",
                                                   "actor.parallelize.offload_params=false"]),
        ("actor.parallelize.activation_checkpoint=memory_budget",
         ["actor.parallelize.activation_checkpoint=memory_budget works through torch.compile",
          "actor.parallelize.compile=true"]),
        ("actor.backend=megatron:d2", ["actor.backend", "cannot launch"]),
        # a recipe's defining keys, and settings of models the run does not have
        ("algo.ppo.use_critic=true", ["algo.ppo.use_critic=True contradicts algo.name='grpo'", "algo.name=ppo"]),
        ("algo.name=nope", ["algo.name: 'nope' is not one of", "ppo"]),
        ("critic.backend=archon:d2", ["critic.backend is set but does nothing", "algo.ppo.use_critic=true"]),
        ("critic.optimizer.lr=0.001", ["critic.optimizer is set but does nothing"]),
        ("algo.ppo.value_eps_clip=0.5", ["algo.ppo.value_eps_clip is set but does nothing"]),
        ("algo.ppo.kl_in_loss=true", ["algo.ppo.kl_in_loss is set but does nothing", "algo.ppo.kl_ctl > 0"]),
        ("algo.ppo.kl_estimator=k3", ["algo.ppo.kl_estimator is set but does nothing"]),
    ],
)
def test_refused_at_load_naming_the_key(override, fragments):
    with pytest.raises(ConfigError) as info:
        load_run_config(None, [override])
    for fragment in fragments:
        assert fragment in str(info.value)


def test_range_is_in_the_keys_table():
    from tandem.config.keys_doc import keys_markdown
    from tandem.rl.config import TandemConfig

    row = next(r for r in keys_markdown(TandemConfig).splitlines() if r.startswith("| `gen.top_p`"))
    assert "Range (0.0, 1.0]." in row


def test_listed_servers_may_use_any_layout():
    """Servers started elsewhere are used by address: their layout is theirs (for `tandem train`,
    their kind must also take its weight sync, tests/config/test_loader.py)."""
    load_run_config(None, ["rollout.backend=sglang:d2t2", "rollout.servers=[127.0.0.1:1]"], command="sft")


def test_actor_path_must_be_a_model_directory(tmp_path, model_dir):
    load_run_config(None, [f"actor.path={model_dir}"])
    with pytest.raises(ConfigError, match=r"actor.path: .*nope.* does not exist"):
        load_run_config(None, [f"actor.path={tmp_path / 'nope'}"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"actor.path: .*empty.* has no config.json"):
        load_run_config(None, [f"actor.path={tmp_path / 'empty'}"])
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"actor.path: .*weightless.* has no \*.safetensors"):
        load_run_config(None, [f"actor.path={weightless}"])
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (odd / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"actor.path: .*odd/config.json' names no model_type"):
        load_run_config(None, [f"actor.path={odd}"])


def test_server_args_are_checked(capsys):
    """Flags for launched servers parse as `tandem serve` options (checked by the command line,
    which owns that parser) and leave the launcher's own flags alone."""
    from tandem.cli import main

    assert main(["show-config", "rollout.server_args=[--num-treads, '1']"]) == 2
    assert "rollout.server_args: unrecognized arguments: --num-treads 1" in capsys.readouterr().err
    assert main(["show-config", "rollout.server_args=[--max-num-seqs, many]"]) == 2
    assert "rollout.server_args: argument --max-num-seqs: invalid int value: 'many'" in capsys.readouterr().err
    assert main(["show-config", "rollout.server_args=[--port, '1234']"]) == 2
    assert "rollout.server_args: --port is set by the launcher" in capsys.readouterr().err
    assert main(["show-config", "rollout.server_args=[--num-threads, '1', --max-num-seqs, '8']"]) == 0


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["gen.top_p=1.5"], "gen.top_p: 1.5 is above the maximum"),
        (["task.name=nope"], "task.name: unknown task 'nope'"),
        (["rollout.backend=tandem:d2t2"], "rollout.backend"),
        (["algo.ppo.kl_in_loss=true"], "algo.ppo.kl_in_loss"),
        ([], "actor.path is not set"),
        (["actor.path=/nonexistent/model"], "actor.path: '/nonexistent/model' does not exist"),
    ],
)
def test_train_refuses_before_creating_anything(tmp_path, model_dir, args, fragment):
    """`tandem train` with a bad value: exit 2 in seconds (against the interpreter's start-up
    measured beside it) with the key named, no traceback, and no run directory (nothing launched)."""
    overrides = [f"experiment.fileroot={tmp_path / 'runs'}", "stats.progress=false"]
    if not any(a.startswith("actor.path") for a in args) and args:
        overrides.append(f"actor.path={model_dir}")
    start = time.monotonic()
    proc = subprocess.run([TANDEM, "train", *overrides, *args], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    print(f"{args}: exit {proc.returncode} after {took:.1f}s: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
    assert took < refusal_bound_s()


def test_expert_layout_checked_against_the_model(tmp_path, model_dir):
    """`e` needs a MoE model whose experts it divides; etp must divide its moe_intermediate_size."""
    with pytest.raises(ConfigError, match=r"actor.backend='archon:d2e2': expert parallelism \(ep=2, etp=1\) needs "
                                          r"a mixture-of-experts model"):
        load_run_config(None, [f"actor.path={model_dir}", "actor.backend=archon:d2e2"])
    moe = tmp_path / "moe"
    moe.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "num_experts": 6, "moe_intermediate_size": 6}))
    (moe / "model.safetensors").write_bytes(b"")
    load_run_config(None, [f"actor.path={moe}", "actor.backend=archon:d2e2"])
    with pytest.raises(ConfigError, match=r"num_experts \(6\) is not divisible by the expert layout's 4"):
        load_run_config(None, [f"actor.path={moe}", "actor.backend=archon:d4e4"])
    with pytest.raises(ConfigError, match=r"moe_intermediate_size \(6\) is not divisible by the expert layout's 4"):
        load_run_config(None, [f"actor.path={moe}", "actor.backend=archon:(attn:d1t4|ffn:e1t4)"])
