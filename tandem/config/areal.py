"""An AReaL experiment config read as a Tandem run config (`tandem convert-config`).

`read_areal(path, overrides)` reads AReaL's YAML with its Hydra-style overrides (`key=value`,
`+key=value`, `++key=value`, `~key`) and resolves its `${...}` interpolations;
`convert(areal)` maps every leaf key to Tandem's keys and returns a `Conversion`: the `Mapped`
entries (AReaL key -> Tandem key = value, with a note where the value was adjusted or stands for an
AReaL default that differs from Tandem's) and the `Unmapped` ones, each with the reason it has no
counterpart. No key is dropped silently: a key without a rule is `Unmapped` too. The result is a
plain nested dict (`Conversion.tandem`); loading it with the run-config schema is the caller's
check (this room sits below the schema). The table of rules is in docs/configuration.md, "Coming
from AReaL"."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tandem.config.alloc import AllocationMode, parse_allocation
from tandem.errors import AllocationError, ConfigError

# AReaL's defaults (areal/api/cli_args.py) that the rules below use when a file leaves a key unset.
AREAL_GRADIENT_CHECKPOINTING = False
AREAL_AC_MODE = "selective"
AREAL_SELECTIVE_AC_OPTION = "op"
AREAL_PP_SCHEDULE = "Interleaved1F1B"
# Defaults that differ from Tandem's and are written when their section is present but they are not.
AREAL_DEFAULTS: dict[str, Any] = {
    "actor.dtype": "bfloat16",
    "actor.optimizer.lr": 1e-3,
    "actor.optimizer.warmup_steps_proportion": 0.001,
}
# The pipeline schedules Tandem runs (`tandem.parallel.config.PP_SCHEDULE_CHOICES`, one room up).
TANDEM_PP_SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "I1F1B", "IZB", "ZBV")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "IZB", "ZBV", "DualPipeV")
TANDEM_SCHEDULERS = ("local", "ray", "slurm")
TANDEM_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Mapped:
    """`areal` (a key of the file, or one it leaves at an AReaL default: `default` says which) ->
    Tandem's `tandem` = `value`; `note` says why where the value is not the AReaL one as written."""

    areal: str
    tandem: str
    value: Any
    note: str = ""
    default: Any = None
    is_default: bool = False

    def line(self) -> str:
        source = self.areal
        if self.is_default:
            source += " (unset" + ("" if self.default is None else f"; AReaL's default {_show(self.default)}") + ")"
        return f"{source} -> {self.tandem} = {_show(self.value)}" + (f"  # {self.note}" if self.note else "")


@dataclass(frozen=True)
class Unmapped:
    """An AReaL key with no counterpart in Tandem, and why."""

    areal: str
    value: Any
    reason: str

    def line(self) -> str:
        return f"{self.areal} = {_show(self.value)}: {self.reason}"


@dataclass
class Conversion:
    """What `convert` made of one AReaL config, in the file's key order."""

    mapped: list[Mapped] = field(default_factory=list)
    unmapped: list[Unmapped] = field(default_factory=list)

    @property
    def tandem(self) -> dict[str, Any]:
        """The Tandem run config (nested sections) the mapped entries write."""
        out: dict[str, Any] = {}
        for m in self.mapped:
            *sections, leaf = m.tandem.split(".")
            node = out
            for part in sections:
                node = node.setdefault(part, {})
            if leaf in node and node[leaf] != m.value:
                raise AssertionError(f"conversion wrote {m.tandem} twice: {node[leaf]!r} and {m.value!r}")
            node[leaf] = m.value
        return out

    def report(self) -> str:
        """The mapping as printed: one line per AReaL key, then the keys without a counterpart."""
        lines = ["AReaL key -> Tandem key = value"]
        lines += [f"  {m.line()}" for m in self.mapped]
        n = len(self.unmapped)
        lines.append(f"No counterpart in Tandem ({n} key{'s' * (n != 1)}, not written):" if self.unmapped
                     else "No counterpart in Tandem: none")
        lines += [f"  {u.line()}" for u in self.unmapped]
        return "\n".join(lines)


# --- reading -----------------------------------------------------------------------------------


def read_areal(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """AReaL's config as a plain dict: the YAML file, then Hydra-style overrides in order
    (`key=value` and `+key=value` set, `++key=value` too, `~key` removes), interpolations resolved."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"AReaL config {str(path)!r} does not exist; pass the path of its YAML file")
    try:
        cfg = OmegaConf.load(path)  # OmegaConf's YAML: `2e-5` is a float, as AReaL reads it
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError(f"AReaL config {str(path)!r} is not valid YAML: {exc}") from None
    for item in overrides:
        key, eq, value = item.lstrip("+").partition("=")
        if item.startswith("~"):
            _delete(cfg, item[1:].partition("=")[0], item)
            continue
        if not eq or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} must look like key.sub=value, +key.sub=value or ~key.sub "
                              "(Hydra's forms, as AReaL takes them)")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{key}={value}"]))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"override {item!r}: {str(exc).splitlines()[0]}") from None
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"AReaL config {str(path)!r}: cannot resolve {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"AReaL config {str(path)!r} must hold a mapping of sections")
    return data  # type: ignore[return-value]


def _delete(cfg: Any, key: str, item: str) -> None:
    *sections, leaf = key.split(".")
    node = cfg
    for part in sections:
        node = node.get(part) if node is not None else None
    if node is None or leaf not in node:
        raise ConfigError(f"override {item!r} removes {key}, which the config does not have")
    del node[leaf]


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value if value and value.strip() == value else repr(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


# --- converting --------------------------------------------------------------------------------


@dataclass
class _Facts:
    """What the rules need to know about the whole config."""

    keys: dict[str, Any]  # every leaf key of the AReaL config -> its value, in file order
    rollout_devices: int = 0
    actor_devices: int = 0
    tp: int = 1
    pp: int = 1
    checkpointing: str = "none"  # Tandem's activation_checkpoint the AReaL keys come to


Rule = Callable[[str, Any, "_Facts"], "list[Mapped | Unmapped]"]


def convert(areal: Mapping[str, Any]) -> Conversion:
    """Map every leaf key of `areal` (as `read_areal` returns it); see the module docstring."""
    facts = _Facts(keys=dict(_leaves(areal)))
    entries: list[tuple[str, Mapped | Unmapped]] = []  # (the file key each one is listed with, entry)
    entries += _allocation(facts)
    entries += _checkpointing(facts)
    entries += _compile_and_schedule(facts)
    entries += _cluster(facts)
    for key, default in AREAL_DEFAULTS.items():
        section = key.rpartition(".")[0]
        if key not in facts.keys and any(k.startswith(section + ".") for k in facts.keys):
            for entry in RULES[key](key, default, facts):
                assert isinstance(entry, Mapped)
                entries.append((next(k for k in facts.keys if k.startswith(section + ".")),
                                Mapped(entry.areal, entry.tandem, entry.value, entry.note, default, True)))
    # The groups above answer for the keys they read; every other key goes through its rule, and a
    # key no rule names is listed as such: none is dropped.
    done = {entry.areal for _, entry in entries}
    for key, value in facts.keys.items():
        if key in done:
            continue
        rule = (RULES.get(key) or next((r for suffix, r in SUFFIX_RULES if key.endswith(suffix)), None)
                or next((r for prefix, r in PREFIX_RULES if key.startswith(prefix)), _no_rule))
        entries += [(key, e) for e in rule(key, value, facts)]
    order = {key: i for i, key in enumerate(facts.keys)}
    entries.sort(key=lambda pair: order[pair[0]])  # stable: a default stays after the key that brought it
    result = Conversion()
    for _, entry in entries:
        (result.mapped if isinstance(entry, Mapped) else result.unmapped).append(entry)
    return result


def _no_rule(key: str, value: Any, facts: _Facts) -> list[Mapped | Unmapped]:
    return [Unmapped(key, value, "the converter has no rule for this key; look for its counterpart in "
                                 "`tandem show-config --keys` (docs/configuration.md)")]


def _to(tandem: str, values: Mapping[Any, Any] | None = None, note: str = "") -> Rule:
    """A rename (with `values` translating the value, where the names differ)."""
    def rule(key: str, value: Any, facts: _Facts) -> list[Mapped | Unmapped]:
        if values is not None:
            if not isinstance(value, Hashable) or value not in values:
                return [Unmapped(key, value, f"Tandem's {tandem} has no counterpart for {_show(value)} "
                                             f"(AReaL's values it maps: {', '.join(map(_show, values))})")]
            value = values[value]
        return [Mapped(key, tandem, value, note)]
    return rule


def _to_many(*tandem: str, note: str = "") -> Rule:
    def rule(key: str, value: Any, facts: _Facts) -> list[Mapped | Unmapped]:
        return [Mapped(key, t, value, note) for t in tandem]
    return rule


def _none(reason: str) -> Rule:
    def rule(key: str, value: Any, facts: _Facts) -> list[Mapped | Unmapped]:
        return [Unmapped(key, value, reason)]
    return rule


def _same_as(top: str, tandem: str) -> Rule:
    """AReaL repeats a top-level value in a section (`actor.experiment_name: ${experiment_name}`)."""
    def rule(key: str, value: Any, facts: _Facts) -> list[Mapped | Unmapped]:
        if value == facts.keys.get(top):
            return [Unmapped(key, value, f"the same as {top}: one key in Tandem, {tandem}")]
        return [Unmapped(key, value, f"differs from {top} ({_show(facts.keys.get(top))}); Tandem has one "
                                     f"{tandem} per run")]
    return rule


# Launched servers: `tandem serve` and Tandem's vLLM launch run one device per server.
LAUNCHED_INFERENCE = ("tandem", "vllm")


def _allocation(facts: _Facts) -> list[tuple[str, Mapped | Unmapped]]:
    """`allocation_mode` (AReaL's legacy single string) or `rollout.backend` / `actor.backend`."""
    out: list[tuple[str, Mapped | Unmapped]] = []
    parts: dict[str, tuple[str, str]] = {}  # "rollout" | "actor" -> (spec, the AReaL key it came from)
    legacy = facts.keys.get("allocation_mode")
    if legacy:
        for group in _top_level_groups(str(legacy)):
            mode = _parse(group, "allocation_mode")
            if len(mode.components) > 1:
                out.append(("allocation_mode", Unmapped("allocation_mode", legacy, f"{group!r} colocates components "
                            "('|'); Tandem runs servers and trainers on separate devices: give rollout.backend "
                            "and actor.backend")))
                continue
            role = "rollout" if mode.components[0].is_inference else "actor"
            parts[role] = (group, "allocation_mode")
    elif legacy is not None:
        out.append(("allocation_mode", Unmapped("allocation_mode", legacy, "empty: AReaL's per-engine backend keys "
                                                                           "say it (rollout.backend, actor.backend)")))
    for role in ("rollout", "actor"):
        key = f"{role}.backend"
        if key in facts.keys:
            if parts.get(role, ("", ""))[1] == "allocation_mode":
                out.append(("allocation_mode", Unmapped("allocation_mode", legacy, f"its {role} part is superseded by "
                                                        f"{key}, as in AReaL (allocation_mode is deprecated there)")))
            parts[role] = (str(facts.keys[key]), key)
    if "actor" in parts:
        spec, source = parts["actor"]
        comp = _parse(spec, source).components[0]
        facts.actor_devices, facts.tp, facts.pp = comp.sizes.world_size, comp.sizes.tp, comp.sizes.pp
        out.append((source, Mapped(source, "actor.backend", spec,
                                   "the trainer part of allocation_mode" if source == "allocation_mode" else "")))
    if "rollout" in parts:
        spec, source = parts["rollout"]
        comp = _parse(spec, source).components[0]
        facts.rollout_devices = comp.sizes.world_size
        s = comp.sizes
        launched = comp.backend in LAUNCHED_INFERENCE and s.tp == 1 and s.pp == 1
        if launched:
            out.append((source, Mapped(source, "rollout.backend", spec)))
        else:
            target = f"tandem:d{s.world_size}"
            why = ("Tandem starts no SGLang servers" if comp.backend == "sglang"
                   else f"Tandem starts {comp.backend} servers on one device each")
            out.append((source, Mapped(source, "rollout.backend", target,
                                       f"adjusted: {why}, so the same {s.world_size} devices serve as {s.world_size} "
                                       f"`tandem serve` servers; to keep {spec}, start those servers yourself and "
                                       f"pass rollout.backend={spec} rollout.servers=[host:port, ...]")))
    return out


def _parse(spec: str, key: str) -> AllocationMode:
    try:
        return parse_allocation(spec)
    except AllocationError as exc:
        raise ConfigError(f"AReaL's {key}={spec!r}: {exc}") from None


def _top_level_groups(spec: str) -> list[str]:
    """`spec` split at the `+` outside parentheses."""
    groups, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += (ch == "(") - (ch == ")")
        if ch == "+" and depth == 0:
            groups.append(spec[start:i])
            start = i + 1
    return [*groups, spec[start:]]


def _checkpointing(facts: _Facts) -> list[tuple[str, Mapped | Unmapped]]:
    """`actor.gradient_checkpointing` switches AReaL's activation checkpointing on;
    `actor.archon.ac_mode` and `selective_ac_option` say how."""
    keys = facts.keys
    if not any(k.startswith("actor.") for k in keys):
        return []
    gc_key, mode_key, option_key = ("actor.gradient_checkpointing", "actor.archon.ac_mode",
                                    "actor.archon.selective_ac_option")
    anchor = gc_key if gc_key in keys else next(k for k in keys if k.startswith("actor."))
    on = bool(keys.get(gc_key, AREAL_GRADIENT_CHECKPOINTING))
    mode = str(keys.get(mode_key, AREAL_AC_MODE))
    option = str(keys.get(option_key, AREAL_SELECTIVE_AC_OPTION))
    target = "actor.parallelize.activation_checkpoint"
    out: list[tuple[str, Mapped | Unmapped]] = []

    def mapped(key: str, tandem: str, value: Any, default: Any, note: str = "", near: str = "") -> None:
        where = key if key in keys else near if near in keys else anchor
        out.append((where, Mapped(key, tandem, value, note, default, key not in keys)))

    if not on:
        mapped(gc_key, target, "none", AREAL_GRADIENT_CHECKPOINTING, "false: no activation checkpointing")
        for key in (mode_key, option_key, "actor.archon.ac_memory_budget"):
            if key in keys:
                out.append((key, Unmapped(key, keys[key], f"no effect in AReaL: {gc_key} is false")))
        if keys.get("actor.archon.ac_debug"):
            out.append(("actor.archon.ac_debug", Unmapped("actor.archon.ac_debug", True, f"nothing to report: {gc_key} "
                        "is false, so no block is checkpointed (Tandem refuses ac_debug without checkpointing)")))
        elif "actor.archon.ac_debug" in keys:
            mapped("actor.archon.ac_debug", "actor.parallelize.ac_debug", False, None)
        return out
    if mode not in ("none", "full", "selective", "memory_budget"):
        raise ConfigError(f"{mode_key}={mode!r} is not one of AReaL's modes none, full, selective, memory_budget")
    schedule = str(keys.get("actor.archon.pp_schedule", AREAL_PP_SCHEDULE))
    requested, note = mode, ""
    if facts.pp > 1 and schedule in ZERO_BUBBLE and (mode == "memory_budget" or (mode, option) == ("selective", "op")):
        mode = "full"
        note = (f"adjusted: {schedule} splits backward in two, which {requested} checkpointing"
                f"{' (op-level)' if requested == 'selective' else ''} cannot serve; full, as AReaL falls back to")
    mapped(gc_key, target, mode, AREAL_GRADIENT_CHECKPOINTING, f"true: checkpointing as {mode_key} says")
    mapped(mode_key, target, mode, AREAL_AC_MODE, note)
    facts.checkpointing = mode
    if mode == "selective":
        if option == "op":
            mapped(option_key, "actor.parallelize.ac_selective", "op", AREAL_SELECTIVE_AC_OPTION, near=mode_key)
        elif option.isdigit() and int(option) >= 1:
            mapped(option_key, "actor.parallelize.ac_selective", "layer", AREAL_SELECTIVE_AC_OPTION,
                   f"{option!r}: every {option}-th block", near=mode_key)
            mapped(option_key, "actor.parallelize.ac_every", int(option), AREAL_SELECTIVE_AC_OPTION, near=mode_key)
        else:
            raise ConfigError(f"{option_key}={option!r} must be 'op' or a positive integer string, as in AReaL")
    elif option_key in keys:
        out.append((option_key, Unmapped(option_key, keys[option_key], f"no effect: checkpointing is {mode}")))
    budget_key = "actor.archon.ac_memory_budget"
    if budget_key in keys:
        if mode == "memory_budget":
            mapped(budget_key, "actor.parallelize.ac_memory_budget", keys[budget_key], None)
        else:
            out.append((budget_key, Unmapped(budget_key, keys[budget_key], f"no effect: checkpointing is {mode}")))
    debug_key = "actor.archon.ac_debug"
    if debug_key in keys:
        if keys[debug_key] and mode not in ("full", "selective"):
            out.append((debug_key, Unmapped(debug_key, keys[debug_key], f"nothing to report: {mode_key}={mode} "
                        "checkpoints no block (Tandem refuses ac_debug then)")))
        else:
            mapped(debug_key, "actor.parallelize.ac_debug", bool(keys[debug_key]), None)
    return out


def _compile_and_schedule(facts: _Facts) -> list[tuple[str, Mapped | Unmapped]]:
    """`enable_compile` and `pp_schedule`, adjusted where Tandem cannot run the combination (each
    adjustment says why), and the pipeline's micro-batches."""
    keys = facts.keys
    out: list[tuple[str, Mapped | Unmapped]] = []
    if not any(k.startswith("actor.") for k in keys):
        return out
    anchor = next(k for k in keys if k.startswith("actor."))
    schedule_key, compile_key = "actor.archon.pp_schedule", "actor.archon.enable_compile"
    schedule = str(keys.get(schedule_key, AREAL_PP_SCHEDULE))
    if schedule_key in keys or facts.pp > 1:
        where = schedule_key if schedule_key in keys else anchor
        if schedule in TANDEM_PP_SCHEDULES:
            out.append((where, Mapped(schedule_key, "actor.parallelize.pp_schedule", schedule, "",
                                      AREAL_PP_SCHEDULE, schedule_key not in keys)))
        else:
            out.append((where, Unmapped(schedule_key, schedule, "Tandem runs the pipeline schedules "
                                        f"{', '.join(TANDEM_PP_SCHEDULES)}; choose one in actor.parallelize.pp_schedule")))
    ac_on = facts.checkpointing in ("full", "selective")
    debug = bool(keys.get("actor.archon.ac_debug")) and ac_on
    zero_bubble = facts.pp > 1 and schedule in ZERO_BUBBLE
    reasons = []
    if debug:
        reasons.append("ac_debug observes the ops of eager blocks")
    if ac_on and facts.tp > 1:
        reasons.append(f"torch fails compiling checkpointed tensor-parallel blocks (tp={facts.tp}), so Tandem refuses "
                       "the pair; activation checkpointing is kept")
    if zero_bubble:
        reasons.append(f"{schedule} runs no compiled blocks (AReaL turns compile off for it too)")
    value = keys.get(compile_key)
    if reasons and value is not False:
        where = compile_key if compile_key in keys else anchor
        out.append((where, Mapped(compile_key, "actor.parallelize.compile", False, "adjusted: " + "; ".join(reasons),
                                  None, compile_key not in keys)))
    elif compile_key in keys:
        out.append((compile_key, Mapped(compile_key, "actor.parallelize.compile", bool(value))))
    n_mbs = "actor.mb_spec.n_mbs"
    if n_mbs in keys and keys[n_mbs] is not None:
        out.append((n_mbs, Mapped(n_mbs, "actor.mb.n_mbs", keys[n_mbs])))
        if facts.pp > 1:
            out.append((n_mbs, Mapped(n_mbs, "actor.parallelize.pp_microbatches", keys[n_mbs],
                                      "under pipeline parallelism AReaL's n_mbs is the pipeline's micro-batch count")))
    elif n_mbs in keys:
        out.append((n_mbs, Unmapped(n_mbs, None, "null: Tandem's actor.mb.n_mbs is at least 1 (its default)")))
    return out


def _cluster(facts: _Facts) -> list[tuple[str, Mapped | Unmapped]]:
    """AReaL sizes its cluster; Tandem counts devices from the allocation and runs on GPUs when
    `experiment.device=cuda`."""
    keys = facts.keys
    out: list[tuple[str, Mapped | Unmapped]] = []
    nodes, gpus = keys.get("cluster.n_nodes"), keys.get("cluster.n_gpus_per_node")
    used = facts.rollout_devices + facts.actor_devices
    if "cluster.n_gpus_per_node" in keys:
        out.append(("cluster.n_gpus_per_node", Mapped("cluster.n_gpus_per_node", "experiment.device", "cuda",
                                                      "AReaL runs on GPUs; the count is not a key in Tandem "
                                                      "(see cluster.n_nodes)")))
    elif keys:
        first = next(iter(keys))
        out.append((first, Mapped("cluster.n_gpus_per_node", "experiment.device", "cuda", "AReaL runs on GPUs",
                                  8, True)))
    if "cluster.n_nodes" in keys:
        check = ""
        if isinstance(nodes, int) and isinstance(gpus, int) and used:
            have = nodes * gpus
            check = (f"; checked: {nodes} node{'s' * (nodes != 1)} x {gpus} GPUs = {have} devices, the allocation uses {used} (rollout "
                     f"{facts.rollout_devices} + actor {facts.actor_devices})"
                     + ("" if have >= used else ": too few for it"))
        out.append(("cluster.n_nodes", Unmapped("cluster.n_nodes", nodes, "Tandem takes the device count from "
                    "rollout.backend and actor.backend and places processes with scheduler.type (ray: the Ray "
                    "cluster's nodes; slurm: scheduler.slurm.*)" + check)))
    return out


def _steps(tandem: str) -> Rule:
    """AReaL's `freq_steps` (null: never) as a Tandem every-N-steps key (0: never)."""
    def rule(key: str, value: Any, facts: _Facts) -> list[Mapped | Unmapped]:
        return [Mapped(key, tandem, 0 if value is None else value, "null: never" if value is None else "")]
    return rule


def _importance_level(key: str, value: Any, facts: _Facts) -> list[Mapped | Unmapped]:
    """Tandem's recipes (`algo.name`) own the ratio level: sequence-level ratios are its gspo."""
    if value == "sequence":
        return [Mapped(key, "algo.name", "gspo", "sequence-level ratios are Tandem's gspo recipe, which sets "
                                                 "algo.ppo.importance_level=sequence (docs/algorithms.md)")]
    return _to("algo.ppo.importance_level", {"token": "token"})(key, value, facts)


def _temperature(key: str, value: Any, facts: _Facts) -> list[Mapped | Unmapped]:
    gen = facts.keys.get("gconfig.temperature", 1.0)
    same = "equal to" if value == gen else "differs from"
    return [Unmapped(key, value, f"Tandem's trainer computes log-probs at gen.temperature (here {same} "
                                 f"gconfig.temperature, {_show(gen)})")]


def _dataset_path(key: str, value: Any, facts: _Facts) -> list[Mapped | Unmapped]:
    if isinstance(value, str) and "gsm8k" in value.lower():
        return [Mapped(key, "task.name", "gsm8k", "Tandem's built-in GSM8K task (docs/tasks.md)")]
    return [Unmapped(key, value, "Tandem's data come from a built-in task (task.name: arithmetic, calculator, "
                                 "countdown, gsm8k) or a custom one (docs/tasks.md)")]


def _wandb_mode(key: str, value: Any, facts: _Facts) -> list[Mapped | Unmapped]:
    if facts.keys.get("stats_logger.wandb.project"):  # Tandem's stats.wandb_mode needs the project
        return _to("stats.wandb_mode", {m: m for m in ("online", "offline", "disabled")})(key, value, facts)
    if value == "disabled":
        return [Unmapped(key, value, "Tandem logs to W&B only with stats.wandb_project set (unset: off, as here)")]
    return [Unmapped(key, value, "Tandem logs to W&B when stats.wandb_project is set (see stats_logger.wandb.project)")]


NAME = "experiment.name"
TRIAL = "experiment.trial"
NOT_SFT_NOTE = "tandem train; the same value goes to sft.steps for tandem sft"
RULES: dict[str, Rule] = {
    "experiment_name": _to(NAME),
    "trial_name": _to(TRIAL),
    "seed": _to("experiment.seed"),
    "total_train_steps": _to_many("train.total_steps", "sft.steps"),
    "total_train_epochs": _none("Tandem counts steps (train.total_steps, sft.steps); a task's training items "
                                "are cycled"),
    "total_train_n_seqs": _none("Tandem counts steps (train.total_steps, sft.steps)"),
    "tokenizer_path": _none("Tandem reads the tokenizer from actor.path"),
    "enable_offload": _none("torch_memory_saver offload of the trainer between phases; Tandem has none "
                            "(actor.parallelize.offload_params is FSDP2's CPU offload, another thing)"),
    "cluster.fileroot": _to("experiment.fileroot"),
    "cluster.cluster_name": _none("Tandem has no per-cluster environment presets"),
    "scheduler.type": _to("scheduler.type", {t: t for t in TANDEM_SCHEDULERS}),
    "actor.path": _to("actor.path"),
    "actor.dtype": _to("actor.dtype", {t: t for t in TANDEM_DTYPES}),
    "actor.grad_reduce_dtype": _none("Tandem always reduces gradients in float32 (FSDP2's reduce dtype)"),
    "actor.optimizer.type": _none("Tandem's optimizer is AdamW (decoupled weight decay), which AReaL's 'adam' is; "
                                  "no key"),
    "actor.optimizer.lr": _to("actor.optimizer.lr"),
    "actor.optimizer.weight_decay": _to("actor.optimizer.weight_decay"),
    "actor.optimizer.beta1": _to("actor.optimizer.beta1"),
    "actor.optimizer.beta2": _to("actor.optimizer.beta2"),
    "actor.optimizer.eps": _to("actor.optimizer.eps"),
    "actor.optimizer.gradient_clipping": _to("actor.optimizer.gradient_clipping"),
    "actor.optimizer.lr_scheduler_type": _to("actor.optimizer.lr_scheduler",
                                             {"constant": "constant", "linear": "linear", "cosine": "cosine"}),
    "actor.optimizer.warmup_steps_proportion": _to("actor.optimizer.warmup_steps_proportion"),
    "actor.optimizer.min_lr_ratio": _to("actor.optimizer.min_lr_ratio"),
    "actor.mb_spec.max_tokens_per_mb": _to("actor.mb.max_tokens_per_mb"),
    "actor.mb_spec.n_mbs_divisor": _to("actor.mb.n_mbs_divisor"),
    "actor.mb_spec.packing_algorithm": _to("actor.mb.packing", {"ffd": "ffd", "kk": "kk"}),
    "actor.mb_spec.granularity": _none("Tandem packs sequences one by one (AReaL's granularity 1)"),
    "actor.pad_to_maximum": _none("Tandem packs micro-batches without padding (compiled blocks take the token "
                                  "count as a dynamic dimension)"),
    "actor.disable_dropout": _none("Tandem's models have no dropout"),
    "actor.init_from_scratch": _none("`tandem init-model DIR` writes a randomly initialised model to train from"),
    "actor.attn_impl": _none("the attention of HF transformers models; Tandem runs its own models, whose kernel is "
                             "actor.attention"),
    "actor.use_kernels": _none("HF kernels for transformers models; Tandem runs its own models"),
    "actor.is_critic": _none("Tandem's critic is its own section (critic.*, with algo.ppo.use_critic)"),
    "actor.temperature": _temperature,
    "actor.weight_update_mode": _to("train.weight_sync", {"xccl": "distributed", "disk": "disk"}),
    "actor.offload": _to("actor.parallelize.offload_params", note="FSDP2 CPU offload of parameters, gradients and "
                                                                  "optimizer state"),
    "actor.enable_tree_training": _none("Tandem has no tree training"),
    "actor.archon.attn_type": _to("actor.attention", {"varlen": "varlen", "sdpa": "sdpa"}),
    "actor.archon.offload_params": _to("actor.parallelize.offload_params"),
    "actor.archon.reshard_after_forward_policy": _to("actor.parallelize.reshard_after_forward",
                                                     {"default": "default", "always": "always", "never": "never"}),
    "actor.archon.use_deterministic_algorithms": _to("actor.deterministic"),
    "actor.archon.ac_preserve_rng_state": _none("Tandem's recompute always replays the forward's RNG state (a "
                                                "recomputed stochastic op equals the original)"),
    "actor.archon.pp_layers_per_stage": _none("Tandem splits the layers evenly over the stages; their number per "
                                              "rank is actor.parallelize.pp_stages_per_rank"),
    "actor.archon.pp_first_stage_less_layers": _none("Tandem splits the layers evenly over the stages"),
    "actor.archon.pp_last_stage_less_layers": _none("Tandem splits the layers evenly over the stages"),
    "actor.archon.moe_router_dtype": _none("Tandem's router takes its softmax in float32 and its gate matmul in "
                                           "actor.dtype; no key"),
    "actor.ppo_n_minibatches": _to("train.n_minibatches"),
    "actor.eps_clip": _to("algo.ppo.eps_clip"),
    "actor.eps_clip_higher": _to("algo.ppo.eps_clip_higher"),
    "actor.c_clip": _to("algo.ppo.dual_clip"),
    "actor.reward_scaling": _to("algo.reward.reward_scaling"),
    "actor.reward_bias": _to("algo.reward.reward_bias"),
    "actor.reward_clip": _to("algo.reward.reward_clip"),
    "actor.overlong_reward_penalty": _to("algo.reward.overlong_penalty.enabled"),
    "actor.overlong_tokens": _to("algo.reward.overlong_penalty.overlong_tokens"),
    "actor.overlong_penalty_factor": _to("algo.reward.overlong_penalty.factor"),
    "actor.kl_ctl": _to("algo.ppo.kl_ctl"),
    "actor.kl_estimator": _to("algo.ppo.kl_estimator", {"k1": "k1", "k2": "k2", "k3": "k3"}),
    "actor.discount": _to("algo.advantage.gamma"),
    "actor.gae_lambda": _to("algo.advantage.lam"),
    "actor.importance_sampling_level": _importance_level,
    "actor.prox_logp_method": _to("algo.ppo.prox_logp", {"recompute": "recompute", "loglinear": "loglinear"}),
    "rollout.max_concurrent_rollouts": _to("rollout.max_concurrent_rollouts"),
    "rollout.consumer_batch_size": _to("rollout.consumer_batch_size"),
    "rollout.max_head_offpolicyness": _to("rollout.max_head_offpolicyness"),
    "gconfig.n_samples": _to("gen.n_samples"),
    "gconfig.max_new_tokens": _to("gen.max_new_tokens"),
    "gconfig.temperature": _to("gen.temperature"),
    "gconfig.top_p": _to("gen.top_p"),
    "gconfig.top_k": _to("gen.top_k"),
    "train_dataset.path": _dataset_path,
    "train_dataset.batch_size": _to_many("rollout.consumer_batch_size", "sft.batch_size",
                                         note="prompts (RL episodes) per step; examples per step for tandem sft"),
    "recover.mode": _to("recover.mode", {"disabled": "off", "off": "off", "auto": "auto", "on": "auto"}),
    "recover.retries": _to("recover.retries"),
    "recover.freq_steps": _steps("train.save_every"),
    "evaluator.freq_steps": _steps("train.eval_every"),
    "stats_logger.wandb.mode": _wandb_mode,
    "stats_logger.wandb.project": _to("stats.wandb_project"),
}
# A section repeating the run's names and root (`saver.fileroot: ${cluster.fileroot}`).
SUFFIX_RULES: list[tuple[str, Rule]] = [
    (".experiment_name", _same_as("experiment_name", NAME)),
    (".trial_name", _same_as("trial_name", TRIAL)),
    (".fileroot", _same_as("cluster.fileroot", "experiment.fileroot")),
]
# Whole sections (prefix match, first wins) with one reason.
PREFIX_RULES: list[tuple[str, Rule]] = [
    ("cluster.name_resolve.", _none("Tandem's processes meet through the controller (cluster.host_ip); there is no "
                                    "name-resolve store")),
    ("scheduler.", _none("AReaL's single-controller service options; Tandem's scheduler is scheduler.type with "
                         "scheduler.ray.* or scheduler.slurm.*")),
    ("actor.archon.fp8_config.", _none("Tandem has no FP8 training")),
    ("actor.fsdp.", _none("AReaL's FSDPEngine; Tandem's engine is configured under actor.parallelize.*")),
    ("actor.megatron.", _none("AReaL's MegatronEngine; Tandem's engine is configured under actor.parallelize.*")),
    *((f"actor.optimizer.{k}", _none("fp16 loss scaling (MegatronEngine); Tandem has no loss-scaling keys"))
      for k in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")),
    ("actor.scheduling_spec", _none("Tandem places trainer ranks through scheduler.* (one process per device)")),
    ("actor.scheduling_strategy.", _none("Tandem runs servers and trainers on separate devices")),
    ("actor.use_lora", _none("Tandem trains full weights (no LoRA)")),
    ("actor.lora_", _none("Tandem trains full weights (no LoRA)")),
    ("actor.target_modules", _none("Tandem trains full weights (no LoRA)")),
    ("actor.peft_type", _none("Tandem trains full weights (no LoRA)")),
    ("actor._version", _none("AReaL's controller-v2 gateway; Tandem has one controller")),
    ("actor.admin_api_key", _none("AReaL's controller-v2 gateway; Tandem has one controller")),
    ("actor.log_level", _none("AReaL's controller-v2 gateway; Tandem has one controller")),
    ("actor.request_timeout", _none("AReaL's controller-v2 gateway; Tandem has one controller")),
    ("actor.setup_timeout", _none("AReaL's controller-v2 gateway; Tandem has one controller")),
    ("rollout.scheduling_spec", _none("Tandem places servers through scheduler.* (one process per server)")),
    ("train_dataset.", _none("Tandem's data loading is the task's (task.*); no loader options")),
    ("valid_dataset.", _none("Tandem evaluates task.eval_size items of the task's eval split")),
    ("saver.", _none("Tandem writes the trained HF model at the end (sft: sft.output); resumable checkpoints: "
                     "train.save_every")),
    ("recover.", _none("Tandem's recovery keys are recover.mode, recover.retries and train.save_every")),
    ("evaluator.", _none("Tandem evaluates every train.eval_every steps and before and after training")),
    ("stats_logger.", _none("Tandem writes metrics.jsonl and TensorBoard to the run directory (stats.*)")),
    ("sglang.", _none("options of AReaL-launched SGLang servers; Tandem's servers take rollout.server_args")),
    ("vllm.", _none("options of AReaL-launched vLLM servers; Tandem's take rollout.vllm.*")),
]
