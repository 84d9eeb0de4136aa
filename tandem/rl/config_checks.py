"""Checks of run-config values that need more than field metadata: a model directory, the user's
reward function, core lists, and settings of models the run does not have. Each raises
`ConfigError` naming the key."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tandem.algo.config import AlgoConfig, PPOConfig
from tandem.errors import ConfigError
from tandem.launch.affinity import parse_cpus

if TYPE_CHECKING:
    from tandem.rl.config import CriticConfig, ReferenceConfig
    from tandem.rollout.config import RolloutConfig


def check_model_sections(algo: AlgoConfig, critic: CriticConfig, ref: ReferenceConfig, prefix: str) -> None:
    """No setting of a model the run does not have: the critic's keys need a critic
    (`algo.ppo.use_critic`), the reference's and the KL options need `algo.ppo.kl_ctl > 0`."""
    unused: list[tuple[str, str]] = []
    if not algo.ppo.use_critic:
        unused += [(f"{prefix}critic.{k}", f"{prefix}algo.ppo.use_critic=true (or {prefix}algo.name=ppo)")
                   for k in _changed(critic)]
        if algo.ppo.value_eps_clip != PPOConfig.value_eps_clip:
            unused.append((f"{prefix}algo.ppo.value_eps_clip", f"{prefix}algo.ppo.use_critic=true"))
    if algo.ppo.kl_ctl == 0:
        unused += [(f"{prefix}ref.{k}", f"{prefix}algo.ppo.kl_ctl > 0, e.g. 0.05") for k in _changed(ref)]
        unused += [(f"{prefix}algo.ppo.{k}", f"{prefix}algo.ppo.kl_ctl > 0, e.g. 0.05")
                   for k in ("kl_estimator", "kl_in_loss") if getattr(algo.ppo, k) != getattr(PPOConfig, k)]
    if unused:
        key, needs = unused[0]
        raise ConfigError(f"{key} is set but does nothing in this run: it needs {needs}. Set that, or remove {key}")


def _changed(section: CriticConfig | ReferenceConfig) -> list[str]:
    """The fields of a config section that differ from its defaults."""
    default = type(section)()
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)]


# The item fields every task's items carry to the reward as keywords (`Task.make_item`; the
# reserved `id`, `prompt`, `messages`, `input_ids` are not passed). Task-specific ones (`expression`,
# `numbers`, ...) are not required by the check.
REWARD_ITEM_FIELDS = ("answer", "task", "split")


def check_reward(spec: str, key: str) -> None:
    """`spec` ('package.module:function' or 'path/to/file.py:function', a file path already made
    absolute by the loader) imports and names a callable that takes the rollout reward's arguments:
    (prompt_text, completion_text, prompt_ids, completion_ids, **item_fields)."""
    from tandem.user_code import check_user_function

    check_user_function(spec, key, args=("", "", [], []), kwargs=dict.fromkeys(REWARD_ITEM_FIELDS, ""),
                        signature="(prompt_text, completion_text, prompt_ids, completion_ids, **item_fields) -> float",
                        relative_to="the directory of the config file that sets it, or the working directory for a "
                                    "command-line override")


def check_agent(spec: str, key: str) -> None:
    """`spec` names an `async def run(client, item)` (the agent workflow's entry)."""
    import inspect

    from tandem.user_code import check_user_function

    fn = check_user_function(spec, key, args=(None, {}), signature="(client, item) -> float",
                             relative_to="the directory of the config file that sets it, or the working directory "
                                         "for a command-line override")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{key}: {spec!r} is not an async function; define it as `async def run(client, item)`: "
                          "the client is an openai.AsyncOpenAI (docs/agents.md)")


def check_model_dir(path: str, key: str) -> None:
    """`path` looks like an HF model directory: config.json naming a model_type, and safetensors
    weights. Reads only config.json (whether that model_type is supported is known once the model
    registry is imported, which costs seconds; the loader says so with the supported list)."""
    import json
    from pathlib import Path

    where = Path(path)
    if not where.exists():
        raise ConfigError(f"{key}: {path!r} does not exist; pass an HF model directory (config.json + "
                          "*.safetensors), e.g. one made by `tandem init-model DIR`")
    if not (where / "config.json").is_file():
        raise ConfigError(f"{key}: {path!r} has no config.json; it must be an HF model directory")
    try:
        model_type = json.loads((where / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{key}: cannot read {str(where / 'config.json')!r}: {exc}") from None
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{key}: {str(where / 'config.json')!r} names no model_type; it must be an HF model config")
    if not any(where.glob("*.safetensors")):
        raise ConfigError(f"{key}: {path!r} has no *.safetensors weights")


def check_cpus(spec: str, key: str) -> None:
    if spec:
        try:
            parse_cpus(spec)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None


def check_weight_sync(update_type: str, rollout: RolloutConfig, prefix: str, verify: bool = False) -> None:
    """The servers' kind can take weight updates of `update_type` (see docs/fleet.md), and report
    checksums when `verify` (train.verify_weights) asks for them."""
    from tandem.fleet.adapters import adapter_for

    capabilities = adapter_for(rollout.server_kind, vllm_extension=rollout.vllm.worker_extension).capabilities
    if verify and not capabilities.checksums:
        raise ConfigError(f"{prefix}train.verify_weights=true compares per-tensor checksums, which "
                          f"{rollout.server_kind} servers ({prefix}rollout.backend={rollout.backend!r}) do not report; "
                          f"set {prefix}train.verify_weights=false or use tandem servers")
    missing = capabilities.missing_for(update_type)
    if missing is not None:
        raise ConfigError(f"{prefix}train.weight_sync={update_type!r} needs {missing}, which "
                          f"{rollout.server_kind} servers ({prefix}rollout.backend={rollout.backend!r}) do not offer; "
                          + ("start them with Tandem's worker extension and set rollout.vllm.worker_extension=true, or "
                             if rollout.server_kind == "vllm" and not rollout.vllm.worker_extension else "")
                          + "use tandem servers (rollout.backend=tandem:dN)")


def check_model_split(path: str, tp: int, cp: int, key: str, ep: int = 1, etp: int = 1) -> None:
    """The model at `path` (a directory `check_model_dir` accepted) splits over the layout: tensor
    parallelism gives each of the `tp` ranks whole key/value heads with their query heads and a
    slice of the MLP (tp divides the key/value heads, query heads and intermediate size); context
    parallelism (Ulysses) splits the query heads over the `cp` ranks; expert parallelism needs a
    mixture-of-experts model whose experts `ep` divides, expert tensor parallelism one whose
    expert hidden size `etp` divides. Counts missing from config.json are left to the model
    loader, which names them."""
    import json
    from pathlib import Path

    from tandem.parallel.cp_heads import check_heads

    config = json.loads((Path(path) / "config.json").read_text())
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if cp > 1 and isinstance(heads, int) and heads > 0:
        check_heads(heads, kv_heads, cp, key)
    if ep > 1 or etp > 1:
        experts = config.get("num_experts") or config.get("num_local_experts")
        if not isinstance(experts, int) or experts < 1:
            raise ConfigError(f"{key}: expert parallelism (ep={ep}, etp={etp}) needs a mixture-of-experts model, and "
                              f"{path} has no num_experts in config.json; drop 'e' and the ffn part")
        for name, count, size in (("num_experts", experts, ep), ("moe_intermediate_size",
                                                                 config.get("moe_intermediate_size"), etp)):
            if isinstance(count, int) and count > 0 and count % size:
                raise ConfigError(f"{key}: the model's {name} ({count}) is not divisible by the expert layout's "
                                  f"{size}; choose sizes that divide it")
    if tp > 1:
        counts = {"num_key_value_heads": kv_heads, "num_attention_heads": heads,
                  "intermediate_size": config.get("intermediate_size")}
        for name, count in counts.items():
            if isinstance(count, int) and count > 0 and count % tp:
                raise ConfigError(f"{key}: tensor parallelism splits the model over tp={tp} ranks, and its {name} "
                                  f"({count}) is not divisible by {tp}; choose a tp that divides it")


# Server kinds whose /generate returns the experts each token went through (`return_routed_experts`).
ROUTE_SERVER_KINDS = ("tandem", "sglang")


def moe_layer_count(path: str) -> int:
    """MoE blocks of the model at `path` (a directory `check_model_dir` accepted), from config.json
    alone: 0 for a dense model. Mirrors `Qwen3MoeArgs.moe_layers` (decoder_sparse_step, mlp_only_layers)."""
    import json
    from pathlib import Path

    config = json.loads((Path(path) / "config.json").read_text())
    experts = config.get("num_experts", config.get("num_local_experts")) or 0
    if not isinstance(experts, int) or experts < 1:
        return 0
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    layers = int(config.get("num_hidden_layers") or 0)
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def check_moe_options(router_replay: str, aux_loss_coef: float, path: str, pp: int, prefix: str,
                      tp: int = 1, live_mismatch: bool = False) -> None:
    """`actor.router_replay` and `actor.moe_aux_loss_coef` need a MoE model (checked when `path` is
    given), and neither runs under pipeline parallelism (the stages do not receive routes); the
    load-balancing loss is not computed under tensor parallelism yet (each TP rank holds the
    router logits of its own token shard). `actor.router_replay_live_mismatch` needs r3."""
    if live_mismatch and router_replay != "r3":
        raise ConfigError(f"{prefix}router_replay_live_mismatch=true logs the mismatch of a live-routed forward next "
                          f"to the replayed one and needs {prefix}router_replay=r3 (it is {router_replay!r}); set "
                          f"{prefix}router_replay=r3 or {prefix}router_replay_live_mismatch=false")
    used = []  # (key=value as set, the value that turns it off)
    if router_replay != "off":
        used.append((f"{prefix}router_replay={router_replay!r}", f"{prefix}router_replay=off"))
    if aux_loss_coef > 0:
        used.append((f"{prefix}moe_aux_loss_coef={aux_loss_coef:g}", f"{prefix}moe_aux_loss_coef=0"))
    if not used:
        return
    if path and moe_layer_count(path) == 0:
        raise ConfigError(f"{used[0][0]} applies to mixture-of-experts models, and {prefix}path={path!r} is a dense "
                          f"model (no MoE layers in its config.json); set {used[0][1]}")
    if aux_loss_coef > 0 and tp > 1:
        raise ConfigError(f"{prefix}moe_aux_loss_coef={aux_loss_coef:g} is not supported with tensor parallelism "
                          f"(tp={tp} from {prefix}backend) yet: each TP rank holds the router logits of its own "
                          f"tokens; use a layout without t, or {prefix}moe_aux_loss_coef=0")
    if pp > 1:
        raise ConfigError(f"{used[0][0]} is not supported with pipeline parallelism (pp={pp} from {prefix}backend): "
                          "routes are not passed to the pipeline stages yet; use a layout without p")


def check_replay_source(router_replay: str, server_kind: str, prefix: str) -> None:
    """r3 replays the routes the rollout servers used: their kind must return them."""
    if router_replay == "r3" and server_kind not in ROUTE_SERVER_KINDS:
        raise ConfigError(f"{prefix}actor.router_replay='r3' replays the routes the rollout servers used, and "
                          f"{server_kind} servers do not return them; use rollout.backend=tandem (or sglang), "
                          f"or {prefix}actor.router_replay=r2 (routes of the trainer's own proximal pass)")
