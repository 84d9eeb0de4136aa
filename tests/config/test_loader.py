"""Config loading: defaults, YAML, overrides, and a clear error for every kind of mistake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.config.loader import to_yaml
from tandem.errors import ConfigError
from tandem.models.tiny import init_model
from tandem.rl.config import TandemConfig, load_run_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults_without_file():
    cfg = load_run_config(None)
    assert isinstance(cfg, TandemConfig)
    assert cfg.actor.optimizer.lr == 1e-6
    assert cfg.rollout.backend == "tandem:d1"


def test_yaml_then_overrides_win(tmp_path):
    path = write(tmp_path, "experiment:\n  name: gsm\n  seed: 3\nactor:\n  optimizer:\n    lr: 2.0e-5\n")
    cfg = load_run_config(path, ["actor.optimizer.lr=3e-5", "rollout.backend=tandem:d2"])
    assert cfg.experiment.name == "gsm"
    assert cfg.experiment.seed == 3
    assert cfg.actor.optimizer.lr == 3e-5
    assert cfg.rollout.backend == "tandem:d2"


def test_interpolation_resolves(tmp_path):
    path = write(tmp_path, "experiment:\n  name: gsm\n  trial: ${experiment.name}-a\n")
    assert load_run_config(path).experiment.trial == "gsm-a"


def test_yaml_round_trip(tmp_path):
    cfg = load_run_config(None, ["actor.dtype=bfloat16", "experiment.seed=7", "actor.backend=archon:d4"])
    again = load_run_config(write(tmp_path, to_yaml(cfg)))
    assert again == cfg


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["actor.optimizer.lrr=1"], ["'actor.optimizer.lrr'", "did you mean 'actor.optimizer.lr'"]),
        (["lr=1e-5"], ["'lr'", "'actor.optimizer.lr'", "valid keys at the top level"]),
        (["actr.path=x"], ["'actr'", "did you mean 'actor'"]),
        (["rollout.seed=1"], ["'rollout.seed'", "'experiment.seed'", "valid keys under 'rollout': backend"]),
    ],
)
def test_unknown_key_names_key_and_closest(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = write(tmp_path, "actor:\n  optimzer:\n    lr: 1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.optimzer' in config file .*cfg.yaml.*'actor.optimizer'"):
        load_run_config(path)


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("actor.optimizer.lr=fast", ["actor.optimizer.lr: expected a number (float), got 'fast'"]),
        ("experiment.seed=1.5", ["experiment.seed: expected an integer, got 1.5"]),
    ],
)
def test_wrong_type_names_field_value_and_type(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [override])
    for fragment in fragments:
        assert fragment in str(err.value)


def test_section_given_a_scalar(tmp_path):
    with pytest.raises(ConfigError, match=r"actor: expected a section .*path, dtype, optimizer, mb, parallelize.*backend.*got 3"):
        load_run_config(write(tmp_path, "actor: 3\n"))


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("actor.dtype=fp8", r"actor.dtype: 'fp8' is not one of 'float32', 'bfloat16', 'float16'"),
        ("actor.optimizer.lr_scheduler=step", r"lr_scheduler: 'step' is not one of 'constant', 'linear', 'cosine'"),
        ("actor.optimizer.lr=-1", r"actor.optimizer.lr: -1.0 is below the minimum 0.0"),
    ],
)
def test_choices_and_minimum(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_run_config(None, [override])


def test_allocation_fields_are_checked():
    with pytest.raises(ConfigError, match=r"actor.backend: 'sglang' is an inference backend but actor.backend takes a training allocation \(archon or fsdp\)"):
        load_run_config(None, ["actor.backend=sglang:d2"])
    with pytest.raises(ConfigError, match=r"rollout.backend: 'archon' is a training backend but rollout.backend takes an inference allocation"):
        load_run_config(None, ["rollout.backend=archon:d2"])
    with pytest.raises(ConfigError, match=r"rollout.backend: invalid allocation mode 'tandem:d0'"):
        load_run_config(None, ["rollout.backend=tandem:d0"])


@pytest.mark.parametrize("override", ["actor.lr", "=3", "actor..lr=1"])
def test_malformed_override(override):
    with pytest.raises(ConfigError, match=r"must look like key.sub=value"):
        load_run_config(None, [override])


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_run_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        load_run_config(write(tmp_path, "actor: [unclosed\n"))
    with pytest.raises(ConfigError, match=r"must hold a mapping"):
        load_run_config(write(tmp_path, "- 1\n- 2\n"))


def test_every_schema_key_is_documented():
    """docs/configuration.md holds exactly the generated table (run `tandem show-config --keys`)."""
    from tandem.config.keys_doc import BEGIN, END, keys_markdown

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    assert BEGIN in doc and END in doc
    documented = doc.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert documented == keys_markdown(TandemConfig, load_run_config(None)), (
        "docs/configuration.md is out of date: paste the output of `tandem show-config --keys` between the markers"
    )


# --- through the command line -------------------------------------------------------------------


def test_cli_show_config_prints_resolved(capsys, tmp_path):
    assert main(["show-config", str(write(tmp_path, "experiment:\n  name: x\n")), "experiment.seed=5"]) == 0
    out = capsys.readouterr().out
    assert "name: x" in out
    assert "seed: 5" in out


def test_cli_bad_key_exits_2(capsys):
    assert main(["show-config", "actor.optimizer.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'actor.optimizer.lrr'" in err
    assert "did you mean 'actor.optimizer.lr'" in err


def test_cli_bad_type_exits_2(capsys):
    assert main(["show-config", "experiment.seed=abc"]) == 2
    assert "experiment.seed: expected an integer, got 'abc' (from command-line overrides)" in capsys.readouterr().err


def test_console_script_exit_code(tmp_path):
    """The installed `tandem` entry point, as a real process."""
    exe = Path(sys.executable).with_name("tandem")
    proc = subprocess.run(
        [str(exe), "show-config", "actor.dtype=int3"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "actor.dtype: 'int3' is not one of" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_example_configs_load(path, tmp_path):
    # actor.path must name a model directory, of the architecture the example is for.
    model = init_model(tmp_path / "model", arch="qwen3_moe" if path.stem == "moe" else "qwen3", preset="tiny", seed=0)
    # So must teacher.path (examples/distill.yaml) and reward_model.path (examples/reward_model.yaml);
    # what kind of model they hold is checked before launch, not by the loader.
    scorer = {"distill": "teacher.path", "reward_model": "reward_model.path"}.get(path.stem)
    load_run_config(path, [f"actor.path={model}"] + ([f"{scorer}={model}"] if scorer else []))


def test_a_bare_off_is_the_off_choice_not_a_boolean(tmp_path):
    """YAML 1.1 reads `off` as false: keys whose choices include 'off' take it as that choice, in a
    file and on the command line (`actor.router_replay=off` once failed: 'False' is not one of)."""
    (tmp_path / "c.yaml").write_text("actor:\n  router_replay: off\nalgo:\n  ppo:\n    behave_imp_weight_mode: off\n")
    for cfg in (load_run_config(tmp_path / "c.yaml", ["rollout.max_head_offpolicyness=0"]),
                load_run_config(None, ["actor.router_replay=off", "algo.ppo.behave_imp_weight_mode=off",
                                       "rollout.max_head_offpolicyness=0"])):
        assert cfg.actor.router_replay == "off" and cfg.algo.ppo.behave_imp_weight_mode == "off"


def test_algo_recipe_sets_defaults_and_overrides_win():
    cfg = load_run_config(None, ["algo.name=dapo", "gen.max_new_tokens=64"])
    assert cfg.algo.ppo.eps_clip_higher == 0.28  # DAPO's clip-higher
    assert cfg.algo.ppo.dynamic_filtering
    assert cfg.algo.reward.overlong_penalty.enabled
    assert cfg.algo.reward.max_new_tokens == 64
    cfg = load_run_config(None, ["algo.name=dapo", "algo.ppo.eps_clip_higher=0.3"])
    assert cfg.algo.ppo.eps_clip_higher == 0.3
    assert load_run_config(None, ["algo.name=dr_grpo"]).algo.advantage.std_level == "none"
    with pytest.raises(ConfigError, match=r"algo.name: 'ppo2' is not one of grpo"):
        load_run_config(None, ["algo.name=ppo2"])


def test_async_without_off_policy_correction_is_refused():
    """Staleness comes from the rollout section; the refusal from the algorithm's rules."""
    load_run_config(None, ["rollout.max_head_offpolicyness=0", "algo.ppo.behave_imp_weight_mode=off"])
    with pytest.raises(ConfigError, match=r"algo.ppo.behave_imp_weight_mode"):
        load_run_config(None, ["rollout.max_head_offpolicyness=2", "algo.ppo.behave_imp_weight_mode=off"])


def test_external_servers_must_be_listed():
    with pytest.raises(ConfigError, match=r"rollout.servers is empty: Tandem does not start sglang servers"):
        load_run_config(None, ["rollout.backend=sglang:d2"])
    cfg = load_run_config(None, ["rollout.backend=vllm:d1", "rollout.servers=[127.0.0.1:8000]"], command="sft")
    assert cfg.rollout.server_kind == "vllm"
    assert load_run_config(None).rollout.launched_by_tandem


@pytest.mark.parametrize(("backend", "sync", "extension"), [
    ("vllm:d1", "distributed", False), ("sglang:d2", "shm", True), ("vllm:d1", "shm", True)])
def test_train_refuses_servers_that_cannot_take_its_weight_sync(backend, sync, extension):
    """Caught when the config loads, naming both keys, instead of when the first update starts."""
    overrides = [f"rollout.backend={backend}", "rollout.servers=[127.0.0.1:8000]", f"train.weight_sync={sync}",
                 f"rollout.vllm.worker_extension={str(extension).lower()}"]
    with pytest.raises(ConfigError, match=rf"train.weight_sync='{sync}' needs .*\(rollout.backend='{backend}'\)"):
        load_run_config(None, overrides)
    if not extension:  # the extension is what vLLM servers lack for it
        with pytest.raises(ConfigError, match=r"set rollout.vllm.worker_extension=true"):
            load_run_config(None, overrides)
        load_run_config(None, overrides[:-1])  # with it (the default), accepted


@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_sglang_servers_take_disk_and_distributed_updates_unstaged(sync):
    """Servers without staged commit (SGLang) get SGLang's own unstaged updates (docs/weight-sync.md)."""
    load_run_config(None, ["rollout.backend=sglang:d1", "rollout.servers=[127.0.0.1:8000]", f"train.weight_sync={sync}"])


@pytest.mark.parametrize("backend", ["vllm:d1", "sglang:d1"])
def test_train_refuses_weight_verification_on_servers_without_checksums(backend):
    overrides = [f"rollout.backend={backend}", "rollout.servers=[127.0.0.1:8000]", "train.weight_sync=disk"]
    load_run_config(None, overrides)  # disk updates go unstaged to them
    with pytest.raises(ConfigError, match=rf"train.verify_weights=true .* {backend.split(':')[0]} servers"):
        load_run_config(None, [*overrides, "train.verify_weights=true"])
