"""The run config of `tandem train` and `tandem sft`: one dataclass per section of a Tandem YAML file.

Every field has a default, so a config file only states what differs; field metadata carries the
help text shown in docs, `choices` and bounds (`tandem.config.fields`). Components own their
sections and are mounted here as they are: `actor` is the training engine's `TrainEngineConfig`
(plus where its ranks run), `rollout` is `tandem.rollout.config`, `algo` is `tandem.algo.config`,
whose `algo.name` picks a recipe that becomes the defaults the file and overrides then adjust.
Keys one section takes from another are derived in one place, `TandemConfig.derive`, and refused
when set (`TandemConfig.DERIVED`). Load with `load_run_config(path, overrides)`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tandem.algo.config import RECIPES, AlgoConfig, PPOConfig, recipe
from tandem.config.alloc import parse_allocation_of_kind
from tandem.config.fields import config_field as _f
from tandem.config.loader import load_config
from tandem.dashboard.record import DashboardConfig
from tandem.data.tasks import TaskError, available_tasks, get_task
from tandem.errors import ConfigError
from tandem.launch import vllm
from tandem.launch.affinity import parse_cpus
from tandem.launch.config import SchedulerConfig
from tandem.parallel.cp_heads import check_heads
from tandem.rollout.config import RolloutConfig
from tandem.rollout.judge import PARSERS, JudgeConfig
from tandem.rollout.reward_model import RewardModelConfig
from tandem.rollout.scoring import ScoringFleetConfig
from tandem.rollout.teacher import TeacherConfig
from tandem.train.config import OptimizerConfig, TrainEngineConfig
from tandem.user_code import check_user_function

COMMANDS = ("train", "sft")


@dataclass
class ExperimentConfig:
    name: str = _f("tandem", "Experiment name; outputs go to fileroot/name/trial.")
    trial: str = _f("trial0", "Trial name within the experiment.")
    seed: int = _f(1, "Seed for Python, NumPy and torch RNGs.", min=0, max=2**32 - 1)
    fileroot: str = _f("runs", "Root directory of logs, checkpoints and weight copies.")
    device: str = _f("cpu", "Device of trainers and launched servers (cuda: one GPU per rank/server).",
                     choices=("cpu", "cuda"))

    def check(self, prefix: str) -> None:
        for key in ("name", "trial"):
            value = getattr(self, key)
            if not value or value in (".", "..") or "/" in value or "\\" in value:
                raise ConfigError(f"{prefix}{key}: {value!r} must be one directory name (outputs go to "
                                  f"fileroot/name/trial), e.g. {prefix}{key}=run1")


@dataclass
class ActorConfig(TrainEngineConfig):
    """The `actor` section: the training engine's own config, handed to every trainer rank as it
    is, plus where the ranks run. Its `device`, `seed` and `total_train_steps` are derived."""

    backend: str = _f("archon:d1", "Training allocation, e.g. 'archon:d2' or 'archon:d2t2' (see tandem alloc).")
    num_threads: int = _f(0, "torch threads per trainer rank (0: torch's default).", min=0)
    cpus: str = _f("", "Pin trainer ranks to these cores, e.g. '1' or '2-3' (empty: no pinning).")

    def derive_sizes(self) -> None:
        """tp, pp, cp, ep and etp from `backend` (left alone when it does not parse: `check` names the key)."""
        try:
            sizes = parse_allocation_of_kind(self.backend, "actor.backend", inference=False).components[0].sizes
        except ConfigError:
            return
        self.tp, self.pp, self.cp, self.ep, self.etp = sizes.tp, sizes.pp, sizes.cp, sizes.ep, sizes.etp

    def check(self, prefix: str = "") -> None:
        comp = parse_allocation_of_kind(self.backend, f"{prefix}backend", inference=False).components[0]
        if comp.run_error:
            raise ConfigError(f"{prefix}backend={self.backend!r}: {comp.run_error}")
        if comp.sizes.dp % self.dp_replicate:
            raise ConfigError(f"{prefix}dp_replicate={self.dp_replicate} must divide the data-parallel size "
                              f"{comp.sizes.dp} of {prefix}backend={self.backend!r}")
        if comp.sizes.pp > 1:
            self.parallelize.check_pipeline(f"{prefix}parallelize.")
        check_cpus(self.cpus, f"{prefix}cpus")
        if self.path:
            check_model_dir(self.path, f"{prefix}path")
            s = comp.sizes
            if s.tp > 1 or s.cp > 1 or s.ep > 1 or s.etp > 1:
                check_model_split(self.path, s.tp, s.cp, f"{prefix}backend={self.backend!r}", s.ep, s.etp)
        check_moe_options(self.router_replay, self.moe_aux_loss_coef, self.path, comp.sizes.pp, prefix,
                          comp.sizes.tp, self.router_replay_live_mismatch)


def _critic_optimizer() -> OptimizerConfig:
    return OptimizerConfig(lr=1e-5)


@dataclass
class CriticConfig:
    """The `critic` section: PPO's value model (`algo.ppo.use_critic`, implied by `algo.name=ppo`).
    It has the actor's architecture with a scalar head, its own engine and optimizer, and is saved
    and resumed with the actor; the actor's dtype, micro-batching and parallelize options apply."""

    path: str = _f("", "HF directory the critic starts from: a value model (...ForTokenClassification, e.g. a critic "
                       "saved by an earlier run) or a causal LM, whose decoder it takes with the value head at zero. "
                       "Empty: actor.path.")
    backend: str = _f("", "Where the critic runs. Empty: on the actor's ranks, as a second engine, data parallel over "
                          "all of them. Or its own ranks, e.g. 'archon:d2' (data parallel layouts only).")
    optimizer: OptimizerConfig = field(default_factory=_critic_optimizer)

    def check(self, prefix: str = "") -> None:
        if self.backend:
            comp = parse_allocation_of_kind(self.backend, f"{prefix}backend", inference=False).components[0]
            s = comp.sizes
            if s.tp > 1 or s.pp > 1 or s.cp > 1 or s.ep > 1 or s.etp > 1:
                raise ConfigError(f"{prefix}backend={self.backend!r}: the critic runs data parallel only (its value head "
                                  "is neither tensor- nor pipeline-parallel); give it e.g. 'archon:d2'")
        if self.path:
            check_model_dir(self.path, f"{prefix}path")


@dataclass
class ReferenceConfig:
    """The `ref` section: the frozen reference model the KL term measures to (`algo.ppo.kl_ctl > 0`).
    It runs on the actor's ranks in the actor's layout and is never trained or saved."""

    path: str = _f("", "HF directory of the reference model (a causal LM of the actor's architecture). Empty: "
                       "actor.path, the actor's initial weights.")

    def check(self, prefix: str = "") -> None:
        if self.path:
            check_model_dir(self.path, f"{prefix}path")


@dataclass
class GenerationConfig:
    n_samples: int = _f(4, "Samples per prompt (the GRPO group size).", min=1)
    max_new_tokens: int = _f(16, "Generation budget per sample.", min=1)
    temperature: float = _f(1.0, "Sampling temperature of rollouts (0: greedy).", min=0.0)
    top_p: float = _f(1.0, "Nucleus sampling threshold.", gt=0.0, max=1.0)
    top_k: int = _f(-1, "Top-k sampling (-1: the whole vocabulary).", min=-1)

    def check(self, prefix: str) -> None:
        if self.top_k == 0:
            raise ConfigError(f"{prefix}top_k: 0 keeps no token; use -1 (the whole vocabulary) or at least 1")


@dataclass
class TaskConfig:
    name: str = _f("arithmetic", "Built-in task: arithmetic, calculator, code, countdown or gsm8k (see docs/tasks.md).")
    options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Task options, e.g. {difficulty: add2, instruction: false}."}
    )
    train_size: int = _f(20000, "Training items generated (cycled in order).", min=1)
    eval_size: int = _f(200, "Evaluation items (greedy, from the eval split); 0: no evaluation (`tandem sft` then starts no server).", min=0)
    system_prompt: str | None = _f(None, "System message prepended to every prompt.")
    reward_timeout_s: float = _f(15.0, "Seconds one reward call may run before it fails (training and evaluation; "
                                       "the task's reward or rollout.reward), counted from when a reward worker "
                                       "takes it up: worker start-up and queueing do not count.", gt=0.0)
    reward_workers: int = _f(2, "Processes that compute rewards, off the controller's event loop.", min=1)

    def check(self, prefix: str) -> None:
        if self.name not in available_tasks():
            raise ConfigError(f"{prefix}name: unknown task {self.name!r}; available: {', '.join(available_tasks())}")
        try:  # builds the task (cheap: data is generated or read later), which checks every option
            get_task(self.name, **dict(self.options))
        except TaskError as exc:
            raise ConfigError(f"{prefix}options: {exc}") from None


@dataclass
class TrainConfig:
    total_steps: int = _f(20, "RL steps (one batch and one weight update each).", min=1)
    n_minibatches: int = _f(1, "Optimizer steps per batch (PPO minibatches).", min=1)
    weight_sync: str = _f("distributed", "How new weights reach the servers (every kind stages, then commits: tandem "
                                         "servers; see docs/fleet.md).", choices=("disk", "distributed", "shm"))
    bucket_mb: int = _f(64, "Weight-sync bucket size in MiB.", min=1)
    verify_weights: bool = _f(False, "After each update, compare per-tensor checksums with every server.")
    eval_every: int = _f(0, "Evaluate every N steps (0: only before and after training).", min=0)
    save_every: int = _f(0, "Save a resumable checkpoint every N steps (0: never).", min=0)
    resume_from: str | None = _f(None, "Directory of a checkpoint written by save_every to continue from "
                                       "(default: the trial's latest checkpoint, if any).")
    overwrite: bool = _f(False, "Replace the outputs of an earlier run of this trial instead of resuming or "
                                "refusing.")
    keep_checkpoints: int = _f(2, "Checkpoints kept in the trial (the newest; older ones are deleted after each "
                                  "save).", min=1)


@dataclass
class ClusterConfig:
    host_ip: str = _f("127.0.0.1", "The controller's address as servers and trainer ranks on other hosts reach it: the "
                                   "ranks' rendezvous, the callback server (ray, slurm) and, with the local scheduler, the "
                                   "weight-update group's store listen on it (ray, slurm: on trainer rank 0's node); "
                                   "127.0.0.1 keeps the run on this machine.")

    def check(self, prefix: str) -> None:
        import ipaddress

        try:
            ipaddress.ip_address(self.host_ip)
        except ValueError:
            raise ConfigError(f"{prefix}host_ip: {self.host_ip!r} is not an IP address; give this host's address on "
                              "the network the servers are on, e.g. 10.0.0.2 (127.0.0.1: one machine)") from None


@dataclass
class RecoverConfig:
    mode: str = _f("auto", "auto: a launch into a trial with a checkpoint continues from checkpoints/LATEST; "
                           "resume: requires one; off: refuses a trial with checkpoints (unless train.overwrite=true).",
                   choices=("auto", "resume", "off"))
    retries: int = _f(0, "After a failure (a dead rank, a crash), relaunch the whole job this many times, each "
                         "resuming from the latest checkpoint.", min=0)


@dataclass
class SFTConfig:
    steps: int = _f(100, "Optimizer steps of `tandem sft`.", min=1)
    batch_size: int = _f(32, "Examples per SFT step.", min=1)
    output: str | None = _f(None, "HF directory the SFT model is written to (default: the run directory/sft).")
    objective: str = _f("lm", "What `tandem sft` trains: `lm`, the next-token loss on the task's answers; `reward`, "
                        "a reward model (a value head on the actor's decoder) on preference pairs, Bradley-Terry "
                        "(docs/rewards.md, \"Training a reward model\").", choices=("lm", "reward"))
    preferences: str | None = _f(None, "With objective=reward: a JSON-lines or parquet file of preference pairs "
                                 "(TRL's formats: prompt/chosen/rejected); its last task.eval_size rows are held "
                                 "out. Unset: pairs from the task's items (reference answer vs another item's).")

    def check(self, prefix: str) -> None:
        if self.objective != "reward" and self.preferences is not None:
            raise ConfigError(f"{prefix}preferences is set but does nothing in this run: it needs "
                              f"{prefix}objective=reward. Set that, or remove {prefix}preferences")


@dataclass
class StatsConfig:
    progress: bool = _f(True, "Show a progress bar.")
    tensorboard: bool = _f(True, "Write TensorBoard event files to the run directory.")
    plot: bool = _f(True, "Write plot.png (reward, accuracy, mismatch, time split) at the end.")
    wandb_project: str | None = _f(None, "Log to this Weights & Biases project (needs `wandb` installed): the config, "
                                         "every step's metrics, plot.png and summary.txt as an artifact.")
    wandb_mode: str = _f("online", "W&B mode with wandb_project: online (uploads as it runs), offline (files in the "
                                   "run directory's wandb/, uploaded later by `wandb sync`) or disabled.",
                         choices=("online", "offline", "disabled"))
    mlflow_tracking_uri: str | None = _f(None, "Log to the MLflow tracking server or store at this URI (needs "
                                               "`mlflow-skinny` or `mlflow` installed): the config as params, every "
                                               "step's metrics, plot.png and summary.txt as artifacts. E.g. "
                                               "http://host:5000; a database store (sqlite:///mlflow.db) needs the "
                                               "full `mlflow`, a file: store MLFLOW_ALLOW_FILE_STORE=true.")
    mlflow_experiment: str | None = _f(None, "MLflow experiment of the run (made if missing); unset: "
                                             "experiment.name.")

    def check(self, prefix: str) -> None:
        import importlib.util

        if self.wandb_mode != StatsConfig.wandb_mode and not self.wandb_project:
            raise ConfigError(f"{prefix}wandb_mode is set but does nothing in this run: it needs "
                              f"{prefix}wandb_project. Set that, or remove {prefix}wandb_mode")
        if self.mlflow_experiment and not self.mlflow_tracking_uri:
            raise ConfigError(f"{prefix}mlflow_experiment is set but does nothing in this run: it needs "
                              f"{prefix}mlflow_tracking_uri. Set that, or remove {prefix}mlflow_experiment")
        for key in ("wandb_project", "mlflow_tracking_uri", "mlflow_experiment"):
            value = getattr(self, key)  # empty: unset
            if value and value != value.strip():
                raise ConfigError(f"{prefix}{key}: {value!r} has surrounding spaces; remove them")
        # The trackers are optional packages: missing ones are named before the run starts anything.
        wanted = [("wandb_project", "wandb", "wandb"), ("mlflow_tracking_uri", "mlflow", "mlflow-skinny")]
        for key, module, package in wanted:
            if getattr(self, key) and importlib.util.find_spec(module) is None:
                raise ConfigError(f"{prefix}{key} is set but {module} is not installed: pip install {package} "
                                  "(or pip install 'tandem[trackers]')")


@dataclass
class TandemConfig:
    """The config of `tandem train`; `SFTRunConfig` is the same sections for `tandem sft`."""

    command: ClassVar[str] = "train"
    # Keys `derive` fills from other sections -> what to set instead (the loader refuses them).
    DERIVED: ClassVar[dict[str, str]] = {
        "actor.device": "experiment.device",
        "actor.seed": "experiment.seed",
        "actor.tp": "actor.backend (e.g. archon:d2t2)",
        "actor.pp": "actor.backend (e.g. archon:p2)",
        "actor.cp": "actor.backend (e.g. archon:d2c2)",
        "actor.ep": "actor.backend (e.g. archon:d2e2)",
        "actor.etp": "actor.backend (e.g. archon:(attn:d2t2|ffn:e2t2))",
        "actor.total_train_steps": "train.total_steps (tandem train: times train.n_minibatches) or sft.steps "
                                   "(tandem sft)",
        "algo.ppo.max_head_offpolicyness": "rollout.max_head_offpolicyness",
        "algo.reward.max_new_tokens": "gen.max_new_tokens",
        "rollout.vllm.lora_rank": "actor.lora.rank (with rollout.backend=vllm and train.weight_sync=disk)",
    }
    # Keys that no longer exist -> what replaced them (the loader names it).
    MOVED: ClassVar[dict[str, str]] = {
        "task.reward_fn": "rollout.reward (the same 'package.module:function', or 'path/to/file.py:function')",
    }

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: ReferenceConfig = field(default_factory=ReferenceConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    gen: GenerationConfig = field(default_factory=GenerationConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def defaults_for(cls, data: dict[str, Any]) -> TandemConfig:
        """Defaults given what the user wrote: `algo.name` selects a recipe (grpo, dapo, ...)."""
        name = (data.get("algo") or {}).get("name", "grpo")
        if name not in RECIPES:
            raise ConfigError(f"algo.name: {name!r} is not one of {', '.join(RECIPES)}")
        max_new_tokens = (data.get("gen") or {}).get("max_new_tokens", GenerationConfig.max_new_tokens)
        return cls(algo=recipe(name, max_new_tokens=int(max_new_tokens)))

    def derive(self) -> None:
        """Copy into each section the values it takes from another: the one place they are set."""
        self.actor.device = self.experiment.device
        self.actor.seed = self.experiment.seed
        self.actor.derive_sizes()
        if self.command == "sft":
            self.actor.total_train_steps = self.sft.steps
        else:  # one optimizer step per minibatch
            self.actor.total_train_steps = self.train.total_steps * self.train.n_minibatches
        self.algo.ppo.max_head_offpolicyness = self.rollout.max_head_offpolicyness
        self.algo.reward.max_new_tokens = self.gen.max_new_tokens
        # vLLM takes the LoRA adapter alone through its own LoRA support, from disk; over a transfer
        # group it gets merged whole weights (docs/lora.md, "Other engines").
        to_vllm = self.command == "train" and self.rollout.server_kind == "vllm"
        lora = self.actor.lora.enabled and to_vllm and self.train.weight_sync == "disk"
        self.rollout.vllm.lora_rank = self.actor.lora.rank if lora else 0

    def check(self, prefix: str = "") -> None:
        # Derived first: the algorithm validates against the rollout's bound and budget.
        self.derive()
        device_type = self.experiment.device.split(":")[0]
        self.actor.parallelize.check_device(device_type, f"{prefix}actor.parallelize.")
        self.actor.check_attention(device_type, f"{prefix}actor.")
        # What the ranks will run with, the options left to the device chosen (as the engine does).
        chosen, _ = self.actor.parallelize.for_device(device_type, self.actor.tp, self.actor.pp)
        chosen.check(f"{prefix}actor.parallelize.")
        chosen.check_layout(self.actor.tp, f"{prefix}actor.parallelize.")
        self.algo.check(f"{prefix}algo.")
        check_model_sections(self.algo, self.critic, self.ref, prefix)
        check_teacher_section(self.teacher, self.algo, self.command, prefix)
        check_reward_section(self.reward_model, self.command, prefix)
        check_reward_section(self.judge, self.command, prefix)
        if self.reward_model.enabled and self.judge.enabled:
            raise ConfigError(f"{prefix}reward_model.path and {prefix}judge.path are both set: a run has one "
                              "model-made reward; remove one (or sum them in your own workflow)")
        if self.scheduler.remote and self.rollout.launched_by_tandem and self.rollout.server_kind == "vllm":
            raise ConfigError(f"{prefix}scheduler.type={self.scheduler.type!r} starts tandem servers only; run the "
                              f"vLLM servers yourself and list them in {prefix}rollout.servers, or use "
                              f"{prefix}rollout.backend=tandem:dN")
        if self.rollout.reward:
            check_reward(self.rollout.reward, f"{prefix}rollout.reward")
        if self.rollout.workflow == "agent" and self.rollout.agent.entry:
            check_agent(self.rollout.agent.entry, f"{prefix}rollout.agent.entry")
        if self.command == "train":
            check_replay_source(self.actor.router_replay, self.rollout.server_kind, prefix)
            check_weight_sync(self.train.weight_sync, self.rollout, prefix, verify=self.train.verify_weights)
            if self.rollout.vllm.lora_rank > vllm.LORA_RANKS[-1]:
                raise ConfigError(f"{prefix}actor.lora.rank={self.actor.lora.rank} is above {vllm.LORA_RANKS[-1]}, the "
                                  f"largest adapter rank vLLM serves; lower it, or set {prefix}train.weight_sync="
                                  "distributed (vLLM then gets merged weights)")
        elif self.sft.objective == "reward" and (self.actor.lora.enabled or self.actor.tp > 1 or self.actor.pp > 1):
            what = "actor.lora.rank" if self.actor.lora.enabled else "actor.backend"
            raise ConfigError(f"{prefix}sft.objective=reward trains a reward model whole (a value head on the "
                              f"decoder), data or context parallel: {prefix}{what} asks for "
                              f"{'LoRA adapters' if self.actor.lora.enabled else 'tensor or pipeline parallel'}; "
                              f"remove it (e.g. {prefix}actor.backend=archon:d2)")
        elif self.actor.router_replay != "off":
            raise ConfigError(f"{prefix}actor.router_replay={self.actor.router_replay!r} replays routes in RL "
                              f"updates (tandem train); `tandem sft` has none to replay: set "
                              f"{prefix}actor.router_replay=off")


@dataclass
class SFTRunConfig(TandemConfig):
    """The config of `tandem sft`: the same sections; the LR schedule spans `sft.steps`."""

    command: ClassVar[str] = "sft"


def load_run_config(path: str | Path | None, overrides: Sequence[str] = (), command: str = "train") -> TandemConfig:
    """The validated run config of `tandem <command>` (train or sft) from an optional YAML file
    and dotted overrides; raises `ConfigError` naming the key for any mistake."""
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {COMMANDS}, got {command!r}")
    return load_config(path, overrides, schema=SFTRunConfig if command == "sft" else TandemConfig)


# Checks of values that need more than field metadata: a model directory, the user's reward
# function, core lists, and settings of models the run does not have. Each raises ConfigError
# naming the key.

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


def check_teacher_section(teacher: TeacherConfig, algo: AlgoConfig, command: str, prefix: str) -> None:
    """A teacher (`teacher.path`) exactly when the KL to it counts (`algo.distill.kl_coef > 0`, in
    `tandem train`); its servers' keys need it. The shared tokenizer is checked before launch
    (`tandem.rl.scorers.check_scorers`): reading tokenizers costs seconds."""
    changed = _changed(teacher)
    if command == "sft":
        if changed:
            raise ConfigError(f"{prefix}teacher.{changed[0]} is set but `tandem sft` has no teacher (it trains on "
                              f"the task's answers); remove it, or distill with `tandem train` and "
                              f"{prefix}algo.name=distill")
        return
    if algo.distill.kl_coef > 0 and not teacher.enabled:
        raise ConfigError(f"{prefix}algo.distill.kl_coef={algo.distill.kl_coef:g}"
                          + (f" ({prefix}algo.name='distill')" if algo.name == "distill" else "")
                          + f" needs a teacher: set {prefix}teacher.path to its HF directory")
    if not teacher.enabled:
        if changed:
            raise ConfigError(f"{prefix}teacher.{changed[0]} is set but does nothing in this run: it needs "
                              f"{prefix}teacher.path (and {prefix}algo.distill.kl_coef > 0, or {prefix}algo.name="
                              f"distill). Set those, or remove {prefix}teacher.{changed[0]}")
        return
    if algo.distill.kl_coef == 0:
        raise ConfigError(f"{prefix}teacher.path is set but does nothing in this run: the teacher's KL counts with "
                          f"{prefix}algo.distill.kl_coef > 0 (or {prefix}algo.name=distill); set it, or remove "
                          f"{prefix}teacher.path")
    teacher.check(f"{prefix}teacher.")
    check_model_dir(teacher.path, f"{prefix}teacher.path")


def check_reward_section(section: RewardModelConfig | JudgeConfig, command: str, prefix: str) -> None:
    """A model-made reward's keys (`reward_model.*`, `judge.*`) need its `path` (and `tandem
    train`). That a reward model is a classifier with one label and shares the actor's tokenizer
    is checked before launch (`tandem.rl.scorers.check_scorers`: the model registry and tokenizers
    cost seconds)."""
    name = section.SECTION
    changed = _changed(section)
    if changed and command == "sft":
        raise ConfigError(f"{prefix}{name}.{changed[0]} is set but `tandem sft` has no reward (it trains on the "
                          f"task's answers); remove it")
    if not section.enabled:
        if changed:
            raise ConfigError(f"{prefix}{name}.{changed[0]} is set but does nothing in this run: it needs "
                              f"{prefix}{name}.path. Set it, or remove {prefix}{name}.{changed[0]}")
        return
    section.check(f"{prefix}{name}.")
    check_model_dir(section.path, f"{prefix}{name}.path")
    if isinstance(section, JudgeConfig) and section.parser not in PARSERS:
        check_user_function(section.parser, f"{prefix}judge.parser", args=("yes",), signature="(text) -> float")


def _changed(section: CriticConfig | ReferenceConfig | ScoringFleetConfig) -> list[str]:
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
    check_user_function(spec, key, args=("", "", [], []), kwargs=dict.fromkeys(REWARD_ITEM_FIELDS, ""),
                        signature="(prompt_text, completion_text, prompt_ids, completion_ids, **item_fields) -> float",
                        relative_to="the directory of the config file that sets it, or the working directory for a "
                                    "command-line override")


def check_agent(spec: str, key: str) -> None:
    """`spec` names an `async def run(client, item)` (the agent workflow's entry)."""
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
    capabilities = rollout.capabilities()
    if verify and not capabilities.checksums:
        raise ConfigError(f"{prefix}train.verify_weights=true compares per-tensor checksums, which "
                          f"{rollout.server_kind} servers ({prefix}rollout.backend={rollout.backend!r}) do not report; "
                          f"set {prefix}train.verify_weights=false or use tandem servers")
    sizes = rollout.allocation.components[0].sizes
    if update_type == "distributed" and rollout.server_kind == "sglang" and sizes.pp > 1:
        raise ConfigError(f"{prefix}train.weight_sync='distributed' with {prefix}rollout.backend={rollout.backend!r}: "
                          f"SGLang's workers join the weight group as rank_offset + their TP rank, so its "
                          f"{sizes.pp} pipeline stages would take the same ranks; use "
                          f"{prefix}train.weight_sync=disk or servers without pipeline parallelism")
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
