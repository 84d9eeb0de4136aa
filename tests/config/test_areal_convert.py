"""`tandem convert-config`: AReaL's configs (the Archon tutorial's examples, copied into fixtures/)
mapped key by key to Tandem's, every key accounted for, and the result loading with Tandem's loader.

The expected Tandem configs are written out by hand from what each AReaL key means
(areal/api/cli_args.py and docs/en/tutorial/archon.md), not from the converter's table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.config.areal import RULES, Conversion, Mapped, convert, read_areal
from tandem.config.loader import schema_keys
from tandem.errors import ConfigError
from tandem.rl.config import TandemConfig, load_run_config

FIXTURES = Path(__file__).parent / "fixtures"
DENSE = FIXTURES / "archon_qwen3_8b.yaml"
MOE = FIXTURES / "archon_qwen3_moe.yaml"
SFT_FP8 = FIXTURES / "gsm8k_sft_archon_fp8.yaml"
TANDEM = str(Path(sys.executable).with_name("tandem"))
TANDEM_KEYS = {key for key, _ in schema_keys(TandemConfig)}

# The tutorial's dense example as Tandem runs it: SGLang d4t2 (8 devices) becomes 8 `tandem serve`
# servers; op-level selective checkpointing is AReaL's default selective_ac_option; compile goes off
# (Tandem refuses compile with checkpointing under TP); bfloat16 is AReaL's default dtype.
DENSE_TANDEM = {
    "experiment": {"name": "archon-gsm8k-grpo", "trial": "trial-0", "device": "cuda"},
    "rollout": {"backend": "tandem:d8"},
    "scheduler": {"type": "ray"},
    "actor": {"backend": "archon:d4p2t2", "dtype": "bfloat16", "path": "Qwen/Qwen3-8B",
              "parallelize": {"activation_checkpoint": "selective", "ac_selective": "op",
                              "pp_schedule": "Interleaved1F1B", "compile": False}},
}


def leaves(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def fixture_keys(path: Path) -> list[str]:
    return list(leaves(yaml.safe_load(path.read_text())))


def listed(conversion: Conversion) -> set[str]:
    """The AReaL keys the printed mapping names at the start of a line (mapped or not)."""
    report = conversion.report().splitlines()
    return {line.strip().split(" ", 1)[0] for line in report[1:] if line.startswith("  ")}


def loads(conversion: Conversion, tmp_path: Path, command: str = "train") -> TandemConfig:
    """The converted config through Tandem's loader, as `tandem <command> OUT.yaml actor.path=...` loads
    it (the fixtures name Hub models, which are no local directories)."""
    out = tmp_path / "converted.yaml"
    out.write_text(yaml.safe_dump(conversion.tandem))
    return load_run_config(out, ["actor.path=''"], command)


def test_the_documents_dense_example_converts_key_by_key(tmp_path):
    conversion = convert(read_areal(DENSE, ["+actor.archon.ac_debug=True"]))
    print("\n" + conversion.report())
    expected = yaml.safe_load(yaml.safe_dump(DENSE_TANDEM))
    expected["actor"]["parallelize"]["ac_debug"] = True
    assert conversion.tandem == expected
    assert set(fixture_keys(DENSE)) | {"actor.archon.ac_debug"} <= listed(conversion)
    assert [u.areal for u in conversion.unmapped] == ["cluster.n_nodes"]
    assert "3 nodes x 8 GPUs = 24 devices, the allocation uses 24 (rollout 8 + actor 16)" in conversion.unmapped[0].reason
    compile_line = next(m for m in conversion.mapped if m.tandem == "actor.parallelize.compile")
    assert compile_line.areal == "actor.archon.enable_compile" and "adjusted" in compile_line.note
    assert "actor.archon.selective_ac_option (unset; AReaL's default op) -> actor.parallelize.ac_selective = op" \
        in conversion.report()
    cfg = loads(conversion, tmp_path)
    p = cfg.actor.parallelize
    assert (cfg.actor.tp, cfg.actor.pp, p.ac_debug, p.activation_checkpoint, p.ac_selective) == (2, 2, True, "selective", "op")


def test_the_documents_moe_example_converts_key_by_key():
    conversion = convert(read_areal(MOE))
    expected = yaml.safe_load(yaml.safe_dump(DENSE_TANDEM))
    expected["experiment"]["name"] = "archon-moe-gsm8k-grpo"
    expected["rollout"]["backend"] = "tandem:d16"  # sglang:d4t4
    expected["actor"].update(backend="archon:(attn:d1p4t2c2|ffn:d1p4t1e4)", path="Qwen/Qwen3-30B-A3B")
    assert conversion.tandem == expected
    assert set(fixture_keys(MOE)) <= listed(conversion)
    assert [u.areal for u in conversion.unmapped] == ["cluster.n_nodes"]


# The tutorial's "Advanced Configuration", "Performance Tuning" and appendix settings, on top of the
# dense example (tp 2, pp 2): what each becomes in actor / actor.parallelize, and the keys without
# a counterpart in effect.
OPTIONS = [
    pytest.param(["+actor.archon.enable_compile=False"], {"compile": False}, [], id="enable_compile"),
    pytest.param(["+actor.archon.use_deterministic_algorithms=True"], {"deterministic": True}, [], id="deterministic"),
    pytest.param(["+actor.archon.offload_params=True"], {"offload_params": True}, [], id="offload_params"),
    pytest.param(["+actor.archon.reshard_after_forward_policy=always"], {"reshard_after_forward": "always"}, [],
                 id="reshard"),
    pytest.param(["actor.archon.pp_schedule=ZBVZeroBubble"],  # AReaL: compile off, op-level AC -> full
                 {"pp_schedule": "ZBVZeroBubble", "compile": False, "activation_checkpoint": "full"}, [], id="zbv"),
    pytest.param(["+actor.mb_spec.n_mbs=4"], {"mb.n_mbs": 4, "pp_microbatches": 4}, [], id="n_mbs"),
    pytest.param(["+actor.archon.selective_ac_option=2"], {"ac_selective": "layer", "ac_every": 2}, [], id="every-2"),
    pytest.param(["actor.archon.ac_mode=full"], {"activation_checkpoint": "full", "compile": False}, [], id="full"),
    pytest.param(["actor.gradient_checkpointing=false", "+actor.archon.ac_debug=True"],
                 {"activation_checkpoint": "none", "compile": True}, ["actor.archon.ac_mode", "actor.archon.ac_debug"],
                 id="no-ac"),
    pytest.param(["+actor.archon.ac_mode=memory_budget", "+actor.archon.ac_memory_budget=0.5"],
                 {"activation_checkpoint": "memory_budget", "ac_memory_budget": 0.5, "compile": True}, [],
                 id="memory_budget"),
]


@pytest.mark.parametrize(("overrides", "expected", "unmapped"), OPTIONS)
def test_the_documents_options(overrides, expected, unmapped, tmp_path):
    conversion = convert(read_areal(DENSE, overrides))
    flat = leaves(conversion.tandem)
    for key, value in expected.items():
        where = f"actor.{key}" if key in ("deterministic", "mb.n_mbs") else f"actor.parallelize.{key}"
        assert flat[where] == value, (where, conversion.report())
    assert sorted(u.areal for u in conversion.unmapped) == sorted(["cluster.n_nodes", *unmapped])
    assert {o.lstrip("+").split("=")[0] for o in overrides} <= listed(conversion)
    if expected.get("activation_checkpoint") == "memory_budget":
        # memory_budget needs compile, and Tandem refuses compile with checkpointing under TP (tp=2 here)
        with pytest.raises(ConfigError, match="not supported with tensor parallelism"):
            loads(conversion, tmp_path)
    else:
        loads(conversion, tmp_path)


def test_an_sft_config_with_every_section_is_accounted_for(tmp_path):
    """AReaL's FP8 SFT example has the sections a real run carries (saver, recover, evaluator,
    stats_logger, datasets, name_resolve, scheduling_spec): each key is mapped or named with its reason."""
    conversion = convert(read_areal(SFT_FP8))
    print("\n" + conversion.report())
    assert set(fixture_keys(SFT_FP8)) <= listed(conversion)
    assert all(u.reason and "no rule" not in u.reason for u in conversion.unmapped)
    reasons = {u.areal: u.reason for u in conversion.unmapped}
    assert reasons["actor.archon.fp8_config.mode"] == "Tandem has no FP8 training"
    assert reasons["saver.fileroot"].startswith("the same as cluster.fileroot")
    flat = leaves(conversion.tandem)
    assert (flat["actor.optimizer.lr"], flat["actor.optimizer.lr_scheduler"], flat["sft.batch_size"],
            flat["task.name"], flat["actor.mb.max_tokens_per_mb"]) == (2e-5, "cosine", 128, "gsm8k", 4096)
    cfg = loads(conversion, tmp_path, "sft")
    assert cfg.actor.optimizer.beta2 == 0.95 and cfg.actor.parallelize.activation_checkpoint == "selective"


def test_a_key_without_a_rule_is_listed_not_dropped():
    conversion = convert({"experiment_name": "x", "actor": {"backend": "archon:d1", "made_up": 3}, "future": {"a": 1}})
    reasons = {u.areal: u.reason for u in conversion.unmapped}
    assert set(reasons) == {"actor.made_up", "future.a"} and all("no rule" in r for r in reasons.values())


# One AReaL value for every key the rules table names: the table may only write keys Tandem has.
EVERY_RULE = {
    "experiment_name": "e", "trial_name": "t", "seed": 3, "total_train_steps": 5, "total_train_epochs": 1,
    "total_train_n_seqs": 100, "tokenizer_path": "x", "enable_offload": False,
    "cluster": {"fileroot": "/tmp/r", "cluster_name": "local"}, "scheduler": {"type": "local"},
    "gconfig": {"n_samples": 4, "max_new_tokens": 32, "temperature": 0.9, "top_p": 0.95, "top_k": 20},
    "rollout": {"backend": "tandem:d1", "max_concurrent_rollouts": 8, "consumer_batch_size": 4,
                "max_head_offpolicyness": 2},
    "actor": {
        "backend": "archon:d1", "path": "", "dtype": "float32", "grad_reduce_dtype": "float32",
        "optimizer": {"type": "adam", "lr": 1e-5, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.99, "eps": 1e-6,
                      "gradient_clipping": 0.5, "lr_scheduler_type": "linear", "warmup_steps_proportion": 0.1,
                      "min_lr_ratio": 0.1},
        "mb_spec": {"max_tokens_per_mb": 1024, "n_mbs_divisor": 1, "packing_algorithm": "kk", "granularity": 1},
        "pad_to_maximum": False, "disable_dropout": True, "init_from_scratch": False, "attn_impl": "sdpa",
        "use_kernels": False, "is_critic": False, "temperature": 0.9, "weight_update_mode": "disk", "offload": False,
        "enable_tree_training": False, "ppo_n_minibatches": 2, "eps_clip": 0.3, "eps_clip_higher": 0.4, "c_clip": 3.0,
        "reward_scaling": 2.0, "reward_bias": -0.5, "reward_clip": 5.0, "overlong_reward_penalty": True,
        "overlong_tokens": 4, "overlong_penalty_factor": 0.5, "kl_ctl": 0.0, "kl_estimator": "k1",
        "discount": 0.99, "gae_lambda": 0.95, "importance_sampling_level": "sequence", "prox_logp_method": "loglinear",
        "archon": {"attn_type": "sdpa", "offload_params": False, "reshard_after_forward_policy": "never",
                   "use_deterministic_algorithms": False, "ac_preserve_rng_state": False, "pp_layers_per_stage": 2,
                   "pp_first_stage_less_layers": 1, "pp_last_stage_less_layers": 1, "moe_router_dtype": "fp32"},
    },
    "train_dataset": {"path": "openai/gsm8k", "batch_size": 4},
    "recover": {"mode": "auto", "retries": 1, "freq_steps": 10},
    "evaluator": {"freq_steps": 5},
    "stats_logger": {"wandb": {"mode": "offline", "project": "p"}},
}


def test_every_rule_writes_a_tandem_key(tmp_path):
    assert set(RULES) <= set(leaves(EVERY_RULE)), "give the new rule's key a value in EVERY_RULE"
    conversion = convert(EVERY_RULE)
    written = {m.tandem for m in conversion.mapped}
    assert written <= TANDEM_KEYS, written - TANDEM_KEYS
    assert set(leaves(EVERY_RULE)) <= listed(conversion)
    cfg = loads(conversion, tmp_path)
    assert (cfg.algo.name, cfg.algo.ppo.importance_level, cfg.train.weight_sync, cfg.algo.advantage.gamma, cfg.gen.top_k,
            cfg.recover.mode, cfg.train.save_every, cfg.stats.wandb_project, cfg.stats.wandb_mode) == (
        "gspo", "sequence", "disk", 0.99, 20, "auto", 10, "p", "offline")


def test_hydra_overrides_and_interpolations(tmp_path):
    src = tmp_path / "a.yaml"
    src.write_text("experiment_name: e\ntrial_name: t\nactor:\n  backend: archon:d1\n  experiment_name: ${experiment_name}\n"
                   "  optimizer:\n    lr: 2e-5\n")
    data = read_areal(src, ["trial_name=u", "+actor.archon.ac_debug=True", "++seed=7", "~actor.experiment_name"])
    assert data == {"experiment_name": "e", "trial_name": "u", "seed": 7,
                    "actor": {"backend": "archon:d1", "optimizer": {"lr": 2e-5}, "archon": {"ac_debug": True}}}
    with pytest.raises(ConfigError, match=r"must look like key\.sub=value"):
        read_areal(src, ["actor.lr"])
    with pytest.raises(ConfigError, match=r"removes actor\.nope, which the config does not have"):
        read_areal(src, ["~actor.nope"])
    with pytest.raises(ConfigError, match="does not exist"):
        read_areal(tmp_path / "missing.yaml")


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([TANDEM, "convert-config", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_cli_prints_the_mapping_and_writes_a_config_tandem_loads(tmp_path):
    proc = run_cli(str(DENSE), "+actor.archon.ac_debug=True", "-o", "out.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    print("\n" + proc.stdout)
    for key in [*fixture_keys(DENSE), "actor.archon.ac_debug"]:
        assert f"\n  {key} " in proc.stdout, key
    assert "  actor.archon.ac_debug -> actor.parallelize.ac_debug = true\n" in proc.stdout
    assert "  cluster.n_nodes = 3: Tandem takes the device count from" in proc.stdout
    assert "actor.path 'Qwen/Qwen3-8B' is not a directory here" in proc.stdout
    assert proc.stdout.rstrip().endswith("wrote out.yaml; it loads for tandem train")
    written = (tmp_path / "out.yaml").read_text()
    assert written.startswith(f"# Converted by `tandem convert-config` from the AReaL config {DENSE} "
                              "+actor.archon.ac_debug=True\n")
    cfg = load_run_config(tmp_path / "out.yaml", ["actor.path=''"])
    assert cfg.actor.parallelize.ac_debug and cfg.rollout.backend == "tandem:d8" and cfg.scheduler.type == "ray"
    # Without -o: the config on stdout (it parses to the same), the mapping on stderr.
    proc = run_cli(str(DENSE), "+actor.archon.ac_debug=True", cwd=tmp_path)
    assert proc.returncode == 0 and yaml.safe_load(proc.stdout) == yaml.safe_load(written)
    assert "AReaL key -> Tandem key = value" in proc.stderr
    assert all(line.startswith("#") for line in proc.stdout.splitlines() if " -> " in line)  # only as comments


def test_the_documents_moe_example_writes_a_config_tandem_loads(tmp_path):
    """Its flagship layout, pipeline x context parallel with the experts folded over the TP and CP
    ranks, loads (it was refused before MoE parallel folding and PP x CP, issue 45 items 1-2)."""
    proc = run_cli(str(MOE), "-o", "moe.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("wrote moe.yaml; it loads for tandem train")
    cfg = load_run_config(tmp_path / "moe.yaml", ["actor.path=''"])
    assert cfg.actor.backend == "archon:(attn:d1p4t2c2|ffn:d1p4t1e4)"
    assert (cfg.actor.pp, cfg.actor.cp, cfg.actor.tp, cfg.actor.ep, cfg.actor.etp) == (4, 2, 2, 4, 1)


def test_cli_refuses_what_would_not_load_and_writes_nothing(tmp_path):
    proc = run_cli(str(DENSE), "experiment_name=a/b", "-o", "out.yaml", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "out.yaml").exists()
    assert ("tandem convert-config: error: the converted config does not load for tandem train (nothing written): "
            "experiment.name: 'a/b' must be one directory name") in proc.stderr
    proc = run_cli(str(tmp_path / "none.yaml"), cwd=tmp_path)
    assert proc.returncode == 2 and "AReaL config" in proc.stderr and "does not exist" in proc.stderr


def test_mapped_lines_read_areal_key_then_tandem_key():
    line = Mapped("actor.archon.enable_compile", "actor.parallelize.compile", False, "why", None, True).line()
    assert line == "actor.archon.enable_compile (unset) -> actor.parallelize.compile = false  # why"


def test_the_mapping_in_docs_is_what_the_converter_prints():
    text = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    block = text.split("$ tandem convert-config archon_qwen3_8b.yaml +actor.archon.ac_debug=True -o run.yaml\n", 1)[1]
    shown = block.split("\nNote: ", 1)[0].splitlines()
    assert shown == convert(read_areal(DENSE, ["+actor.archon.ac_debug=True"])).report().splitlines()


def test_the_legacy_allocation_mode_splits_into_the_two_backends():
    conversion = convert({"allocation_mode": "vllm:d2+archon:d2p2", "actor": {"path": "m"}})
    flat = leaves(conversion.tandem)
    assert (flat["rollout.backend"], flat["actor.backend"], flat["actor.parallelize.pp_schedule"]) == (
        "vllm:d2", "archon:d2p2", "Interleaved1F1B")  # AReaL's default schedule, written for pp > 1
    assert "allocation_mode -> actor.backend = archon:d2p2  # the trainer part of allocation_mode" in conversion.report()
    superseded = convert({"allocation_mode": "vllm:d2+archon:d2", "actor": {"backend": "archon:d1"}})
    assert leaves(superseded.tandem)["actor.backend"] == "archon:d1"
    assert [u.reason for u in superseded.unmapped] == [
        "its actor part is superseded by actor.backend, as in AReaL (allocation_mode is deprecated there)"]
    with pytest.raises(ConfigError, match=r"AReaL's actor\.backend='archon:d0': invalid allocation mode"):
        convert({"actor": {"backend": "archon:d0"}})
